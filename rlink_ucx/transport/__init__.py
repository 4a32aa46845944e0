"""Data-plane backends and the per-peer choice between them."""

from __future__ import annotations

import importlib.util
import socket

from .._errors import ConfigError

TRANSPORTS = ("auto", "tcp", "ucx")


def check_transport(name: str) -> str:
    if name not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    return name


def ucx_available() -> bool:
    """Whether ucxx can be imported here (checked without importing it)."""
    return importlib.util.find_spec("ucxx") is not None


def choose(learner_wants: str, actor_wants: str, *, learner_ucx: bool, actor_ucx: bool) -> tuple[str, str]:
    """Pick a data plane for one actor; returns ``(transport, reason)`` or ``("", why_not)``."""
    wants = {learner_wants, actor_wants} - {"auto"}
    if len(wants) > 1:
        return "", f"learner requires {learner_wants!r} but actor requires {actor_wants!r}"
    if wants == {"tcp"}:
        return "tcp", "requested"
    both_ucx = learner_ucx and actor_ucx
    if wants == {"ucx"}:
        if not both_ucx:
            side = "learner" if not learner_ucx else "actor"
            return "", f"ucx requested but ucxx is not installed on the {side} (pip install 'rlink-ucx[cu12]')"
        return "ucx", "requested"
    # auto. Over plain TCP (no RDMA, no shared memory, no CUDA) UCX is slower than a raw socket
    # on the machines we measured (docs/benchmarks.md), so auto only picks it where it can use
    # a faster path than TCP.
    if not both_ucx:
        return "tcp", "auto: ucxx is not installed on both sides"
    from . import ucx_probe

    fast = ucx_probe.fast_transports()
    if fast:
        return "ucx", f"auto: UCX offers {', '.join(sorted(fast))}"
    return "tcp", "auto: UCX has only TCP here and the tcp plane is faster over plain TCP"


def hostname() -> str:
    return socket.gethostname()

"""Data-plane backends and the per-peer choice between them."""

from __future__ import annotations

import importlib.util
import socket

from ..errors import ConfigError

TRANSPORTS = ("auto", "tcp", "ucx", "shm")
TRANSPORT_HELP = ("data plane: auto picks per actor (shm on the learner's host, ucx where UCX has RDMA or "
                  "CUDA transports, tcp otherwise); tcp, ucx or shm force one")
# How to get the ucx plane (pyproject.toml's extras): ucxx alone on CPU machines, ucxx and cupy on GPU ones.
UCX_INSTALL = "pip install 'rlink-ucx[ucx]' (CPU) or 'rlink-ucx[cu12]' / 'rlink-ucx[cu13]' (CUDA 12 / 13)"


def check_transport(name: str) -> str:
    if name not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    return name


_ucx_broken: str | None = None  # why UCX did not start in this process, once it did not


def ucx_available() -> bool:
    """Whether this process can offer the ucx plane: ucxx can be imported (checked without
    importing it) and UCX has not already failed to start here."""
    return _ucx_broken is None and importlib.util.find_spec("ucxx") is not None


def ucx_failure() -> str | None:
    """Why UCX did not start in this process, if it did not (see :func:`ucx_failed`)."""
    return _ucx_broken


def ucx_failed(why: str) -> None:
    """UCX did not start in this process: stop offering it (a configuration error, which no
    retry cures, so for the rest of the process)."""
    global _ucx_broken
    _ucx_broken = why


def choose(learner_wants: str, actor_wants: str, *, learner_ucx: bool, actor_ucx: bool,
           same_host: bool = False, shm: bool = False) -> tuple[str, str]:  # fmt: skip
    """Pick a data plane for one actor; returns ``(transport, reason)`` or ``("", why_not)``.

    ``same_host``: the actor runs on the learner's host; ``shm``: both sides can share a ring.
    """
    wants = {learner_wants, actor_wants} - {"auto"}
    if len(wants) > 1:
        return "", f"learner requires {learner_wants!r} but actor requires {actor_wants!r}"
    if wants == {"tcp"}:
        return "tcp", "requested"
    if wants == {"shm"}:
        if not same_host:
            return "", "shm requested but the actor runs on another host"
        if not shm:
            return "", "shm requested but this platform cannot share a memfd ring (Linux only)"
        return "shm", "requested"
    both_ucx = learner_ucx and actor_ucx
    if not wants and same_host and shm:
        # Same host: one copy into and one out of a shared ring, no system call per byte. It
        # beats TCP at every size and UCX's own shared memory up to ~1 MiB steps
        # (docs/benchmarks.md); only CUDA transports (device to device) are worth UCX here.
        from . import ucx_probe

        cuda = ucx_probe.fast_transports() & ucx_probe.CUDA if both_ucx else set()
        if cuda:
            return "ucx", f"auto: same host, UCX offers {', '.join(sorted(cuda))}"
        return "shm", "auto: same host, shared-memory ring"
    if wants == {"ucx"}:
        if not both_ucx:
            side = "learner" if not learner_ucx else "actor"
            return "", (f"ucx requested but the {side} offers none (ucxx is not installed there: {UCX_INSTALL}; "
                        "or UCX did not start there: see its log)")
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

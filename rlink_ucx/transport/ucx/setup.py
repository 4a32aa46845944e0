"""Starting UCX for the ``ucx`` plane: ucxx's import, our settings, the session's tags."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ...errors import RLinkError
from ...wire.frame import FRAME_HEADER_BYTES

if TYPE_CHECKING:
    from ...config import Config

# How to get the ucx plane (pyproject.toml's extras): ucxx alone on CPU machines, ucxx and cupy on GPU ones.
UCX_INSTALL = "pip install 'rlink-ucx[ucx]' (CPU) or 'rlink-ucx[cu12]' / 'rlink-ucx[cu13]' (CUDA 12 / 13)"
HEADER_KIND = 0
PAYLOAD_KIND = 1
# A frame's header message: the header and, after it, the frame's small fields (see
# inline_fields), at most this long. Well under the 8 KiB above which ucxx's UCX_RNDV_THRESH
# sends by rendezvous: the header message stays eager, there whole once it is seen.
HEADER_MESSAGE_BYTES = 4096
# Progress calls that found nothing before a busy-polling thread yields its core on every
# further call: with more processes than cores (4 actors and a learner on 2 cores) pure
# spinning starves the very peer it waits for.
SPINS_BEFORE_YIELD = 32


class UcxUnavailable(RLinkError):
    """UCX itself would not start in this process (a bad ``UCX_*`` variable, no usable
    transport): no retry cures it, so it is reported at once instead of retried."""


def inline_fields(lengths: Iterable[int]) -> list[bool]:
    """Which fields of a frame (their byte lengths, in order) travel inside the header's message
    instead of as messages of their own: each non-empty one, in order, while the message stays
    within ``HEADER_MESSAGE_BYTES``. Every message costs a send, a receive and their Python on
    both sides: an Atari frame is 2 messages instead of 6 (4 actors: +8-17% GB/s), a frame of
    small steps one. Actor and learner both decide with this."""
    total, inline = FRAME_HEADER_BYTES, []
    for n in lengths:
        fits = 0 < n and total + n <= HEADER_MESSAGE_BYTES
        total += n if fits else 0
        inline.append(fits)
    return inline


def ucx_options(config: Config, loopback: bool = False, devices: list[str] | None = None) -> dict[str, str]:
    """UCX settings we ship (unless the user set the variable): see docs/transports.md. A user
    who sets ``UCX_TLS`` chooses the transports, sysv included.

    UCX's TCP transport listens on every interface it may use, so it is confined to those of
    the control channel: ``loopback`` (the control channel is on loopback) or ``devices``
    (``ucx_probe.net_devices``)."""
    seg = f"{max(64, config.ucx_segment_bytes // 1024)}k"
    ours = {
        "TCP_TX_SEG_SIZE": seg,
        "TCP_RX_SEG_SIZE": seg,  # must be >= TX or the worker refuses to start
        "RNDV_FRAG_SIZE": "host:4M",
        # sysv segments are made group read/write (mode 660) and listed in /proc/sysvipc/shm:
        # on a host where users share a primary group (common on HPC clusters and OpenShift),
        # another user could read or overwrite the steps in them. posix shared memory and CMA
        # stay: they are open to this user alone.
        "TLS": "^sysv",
    }
    if loopback:
        ours["NET_DEVICES"] = "lo"
    elif devices:
        ours["NET_DEVICES"] = ",".join(devices)
    return {k: v for k, v in ours.items() if f"UCX_{k}" not in os.environ}


def load_ucxx() -> tuple[Any, Any]:
    """Import ucxx's low-level module and its Array (slow the first time: it loads UCX)."""
    try:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array
    except ImportError as exc:  # pragma: no cover - checked by transport.choose first
        raise ImportError(f"the ucx data plane needs ucxx: {UCX_INSTALL}") from exc
    return libucxx, Array


def session_tags(session_key: bytes) -> tuple[int, int]:
    """The session's two UCX tags (its headers', its payloads'), 64 secret bits each.

    UCX matches a message to a receive by tag alone, per worker: whoever knows a session's tag
    can feed its receives. Both are derived from the session's key (from the token and the
    ticket; the ticket alone goes in clear in the Welcome), so they are as hard to guess as 64
    random bits, and one tag tells nothing about the other."""
    digest = hashlib.blake2b(session_key, digest_size=16, person=b"rlink-ucx-tags").digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


def make_worker(config: Config, loopback: bool = False, devices: list[str] | None = None) -> tuple[Any, Any, Any]:
    """A UCX context and worker with our settings: ``(libucxx, context, worker)``."""
    u, _ = load_ucxx()
    options = ucx_options(config, loopback, devices)
    try:
        context = u.UCXContext(options, feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
        return u, context, u.UCXWorker(context)
    except Exception as exc:  # ucxx says only "Invalid parameter"; UCX printed the why on stdout
        ours = ", ".join(f"UCX_{k}={v}" for k, v in sorted(options.items()))
        yours = ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                          if k.startswith("UCX_") and _UCXX_SETS.get(k) != v) or "none"  # fmt: skip
        raise UcxUnavailable(f"UCX did not start ({type(exc).__name__}: {exc}; UCX's own log says why). "
                             f"UCX_* variables set here: {yours}; set by rlink: {ours}") from exc


# What importing ucxx sets unless it is set (ucxx/__init__.py), and load_ucxx's one: left out of
# the error above, which must name the user's variables within the 500 characters of a refusal.
_UCXX_SETS = {"UCX_MEMTYPE_CACHE": "n", "UCX_RNDV_THRESH": "8192", "UCX_RNDV_FRAG_MEM_TYPE": "cuda",
              "UCX_MAX_RNDV_RAILS": "1", "UCX_CUDA_COPY_MAX_REG_RATIO": "1.0", "UCX_PROTO_ENABLE": "n",
              "UCX_WARN_UNUSED_ENV_VARS": "n"}  # fmt: skip

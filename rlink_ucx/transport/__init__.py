"""Data-plane backends, each one :class:`~rlink_ucx.transport.plane.Plane` registered here, and
the per-peer choice between them.

A new plane is one module with its ``Plane`` subclass and one ``register`` line below.
"""

from __future__ import annotations

import socket

from .plane import AUTO, Situation, choose_plane, get_plane, plane_names, register
from .shm.plane import ShmPlane
from .tcp.plane import TcpPlane
from .ucx.plane import UcxPlane, ucx_available, ucx_failed, ucx_failure
from .ucx.setup import UCX_INSTALL

register(TcpPlane)
register(UcxPlane)
register(ShmPlane)

TRANSPORTS = (AUTO, *plane_names())
TRANSPORT_HELP = ("data plane: auto picks per actor (shm on the learner's host, ucx where UCX has RDMA or "
                  "CUDA transports, tcp otherwise); tcp, ucx or shm force one")

__all__ = ["TRANSPORTS", "TRANSPORT_HELP", "UCX_INSTALL", "check_transport", "choose", "hostname", "ucx_available",
           "ucx_failed", "ucx_failure"]


def check_transport(name: str) -> str:
    """``name`` if it is ``"auto"`` or a registered plane's; else ``ConfigError``."""
    if name != AUTO:
        get_plane(name)
    return name


def choose(learner_wants: str, actor_wants: str, *, learner_ucx: bool, actor_ucx: bool,
           same_host: bool = False, shm: bool = False) -> tuple[str, str]:  # fmt: skip
    """Pick a data plane for one actor; returns ``(transport, reason)`` or ``("", why_not)``.

    ``same_host``: the actor runs on the learner's host; ``shm``: both sides can share a ring.
    """
    both = {TcpPlane.name} | ({ShmPlane.name} if shm else set())
    learner = frozenset(both | ({UcxPlane.name} if learner_ucx else set()))
    actor = frozenset(both | ({UcxPlane.name} if actor_ucx else set()))
    return choose_plane(learner_wants, actor_wants, Situation(learner, actor, same_host))


def hostname() -> str:
    return socket.gethostname()

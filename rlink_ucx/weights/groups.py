"""Plain torch.distributed process groups built on a store, leaving ``init_process_group`` and
the default group alone: the broadcast fan-out on trusted networks (``broadcast.py``,
``cast_member.py``) and the gloo baselines of ``rlink bench`` (``bench/fanout.py``).

Every group is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) on a ``PrefixStore``
over the store it is given. ``serve_store`` makes a plain ``TCPStore`` on one address, which
anyone who reaches its port may read and write, and gloo's and NCCL's listeners accept
anyone's connections (gloo keeps every one): only on a network whose every host you trust
(SECURITY.md). The broadcast fan-out puts each group under a fresh random prefix that only
travels on the authenticated control connections, so a stranger cannot guess its keys, but
can still reach the listeners, read what they carry and break the group.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

__all__ = ["abort", "connect_store", "load", "new_group", "serve_store"]


def load() -> Any:
    """torch.distributed, imported under the lock every framework import of rlink's takes
    (``wire.frameworks.IMPORT_LOCK``: torch imported by two threads at once aborts)."""
    from ..wire.frameworks import IMPORT_LOCK

    with IMPORT_LOCK:
        import torch.distributed as dist
    return dist


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def serve_store(host: str, timeout: float) -> tuple[Any, int]:
    """A ``TCPStore`` server listening on ``host`` only (port chosen by the OS); unauthenticated
    (see above)."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family, backlog=128)
    port = sock.getsockname()[1]
    # torch.distributed imports its stores from torch._C without listing them in __all__
    store = dist.TCPStore(host, port, is_master=True, master_listen_fd=sock.detach(),  # type: ignore[attr-defined]
                          timeout=_delta(timeout), wait_for_workers=False)  # fmt: skip
    return store, port


def connect_store(host: str, port: int, timeout: float) -> Any:
    import torch.distributed as dist

    # torch.distributed imports its stores from torch._C without listing them in __all__
    store = dist.TCPStore(host, port, is_master=False,  # type: ignore[attr-defined]
                          timeout=_delta(timeout), wait_for_workers=False)  # fmt: skip
    return store


def new_group(store: Any, prefix: str, rank: int, world: int, *, backend: str, hostname: str, timeout: float) -> Any:
    """A process group of ``world`` ranks on ``store`` under ``prefix``; blocks until every rank
    joined, or raises once ``timeout`` passed. Its collectives time out after ``timeout`` too."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]  # imported from torch._C, as TCPStore
    if backend == "nccl":  # NCCL connects at the first collective
        opts = dist.ProcessGroupNCCL.Options()
        # torch's watchdog may end the process once a collective outlives this: callers bound
        # their waits by ``timeout`` and abort the group first (:func:`abort`).
        opts._timeout = _delta(4 * timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: torch's stubs leave it out
    opts._timeout = _delta(timeout)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    group = dist.ProcessGroupGloo(prefixed, rank, world, opts)
    group._set_default_timeout(_delta(timeout))
    return group


def abort(group: Any) -> None:
    """End a group whose collective failed or timed out, where the backend can (NCCL: its
    kernels stop spinning on the GPU); gloo's ends once its own timeout passed."""
    end = getattr(group, "abort", None) or getattr(group, "_abort", None)
    if end is not None:
        try:
            end()
        except Exception:  # noqa: BLE001, S110 - already broken: nothing more to do
            pass

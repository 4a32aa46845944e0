"""Weights by broadcast on a trusted network: the actor's side (``broadcast.py`` is the learner's).

A host's streamer that the learner asks (``BroadcastJoin``) connects to the learner's store,
says it is joining (its ready key, under the group's random prefix), and builds its end of the
group on the address its control connection comes from. For each version the learner announces
(``Broadcast``) it takes one broadcast per bucket into a fresh buffer of its pool (a sealed memfd
where the host has them, which its peers then read): straight into it with gloo, through a GPU
buffer with NCCL. The subscriber then checks every bucket against the key and Seal from its
control connection, as for a version from a relay. Every collective is bounded
(:func:`bucket_timeout`); one that fails or times out ends this actor's membership, it tells the
learner (``BroadcastJoined``, not ok) and takes the version by stream.

torch is imported only here, and only once the learner asks this actor to join.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import RLinkError
from ..wire import messages as _wire

__all__ = ["CastLink", "bucket_timeout", "connect", "form_timeout", "wait_work"]

log = logging.getLogger(__name__)


def form_timeout(config: Config) -> float:
    """How long forming a group may take, on each side (members import torch meanwhile)."""
    return max(1.0, config.weights_timeout / 2)


def bucket_timeout(config: Config) -> float:
    """How long one bucket's broadcast may take, on each side."""
    return max(1.0, config.weights_timeout / 3)


def wait_work(work: Any, timeout: float, backend: str) -> None:
    """Until a collective ``work`` completes; raises once ``timeout`` passed (or it failed).
    gloo's wait takes the limit; NCCL's does not block the host, so it is polled."""
    if backend != "nccl":
        if not work.wait(datetime.timedelta(seconds=timeout)):
            raise RLinkError(f"broadcast did not complete within {timeout:.3g}s")
        return
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RLinkError(f"NCCL broadcast did not complete within {timeout:.3g}s")
        time.sleep(0.0005)
    work.wait()  # raises what it failed with


def connect(group: Any, backend: str, device: Any, timeout: float) -> None:
    """NCCL connects a group at its first collective: one byte broadcast right after forming
    makes a member that never comes a failure to form (within ``timeout``), on every rank."""
    if backend == "nccl":
        import torch

        wait_work(group.broadcast(torch.zeros(1, dtype=torch.uint8, device=device), 0), timeout, backend)


class _Group:
    __slots__ = ("backend", "group", "id", "staging", "store")

    def __init__(self, gid: int, group: Any, backend: str, store: Any):
        self.id, self.group, self.backend, self.store = gid, group, backend, store
        self.staging: Any = None  # NCCL: the GPU buffer each bucket arrives in


class CastLink:
    """This actor's membership in the learner's broadcast group (the subscriber's thread only)."""

    def __init__(self, config: Config, conn: Any, send: Callable[[Any], None]):
        self.config = config
        self._conn = conn  # the actor's connection: we listen where its control connection comes from
        self._send = send  # a message to the learner, on the control connection
        self._group: _Group | None = None

    @property
    def active(self) -> bool:
        return self._group is not None

    def join(self, msg: _wire.BroadcastJoin) -> None:
        """Join the group ``msg`` names (world 0: leave ours, if not newer)."""
        if msg.world == 0:
            if self._group is not None and self._group.id <= msg.group:
                self.leave()
            return
        self.leave()
        if self.config.weights_fanout != "broadcast":  # never offered: the learner's word is not enough
            self._send(_wire.BroadcastJoined(msg.group, False))
            return
        timeout = form_timeout(self.config)
        try:
            from .groups import connect_store, load, new_group

            dist = load()
            store = connect_store(msg.host, msg.port, timeout)
            dist.PrefixStore(msg.prefix, store).set(f"ready/{msg.rank}", "1")
            group = new_group(store, msg.prefix, msg.rank, msg.world, backend=msg.backend, hostname=self._bind_host(),
                              timeout=timeout)  # fmt: skip
            if msg.backend == "nccl":
                import torch

                connect(group, msg.backend, torch.device("cuda", torch.cuda.current_device()), timeout)
        except Exception as exc:  # noqa: BLE001 - no torch, no store, or the group did not form
            log.info("could not join broadcast group %d: %s", msg.group, exc)
            self._send(_wire.BroadcastJoined(msg.group, False))
            return
        self._group = _Group(msg.group, group, msg.backend, store)
        self._send(_wire.BroadcastJoined(msg.group, True))

    def take(self, msg: _wire.Broadcast, pool: Any) -> tuple[Any, list[Any] | None] | None:
        """Receive ``msg``'s version by broadcast into a fresh buffer of ``pool``: the buffer
        and where it lies (None: not our group's; we take nothing). A failure ends our
        membership (the learner is told) and raises."""
        group = self._group
        if group is None or group.id != msg.group:
            return None
        manifest = msg.manifest
        manifest.validate(max_bytes=self.config.max_weights_bytes, max_entries=self.config.max_weights_tensors)
        flat, where = pool.get(manifest.total_bytes)
        timeout = bucket_timeout(self.config)
        try:
            import torch

            for a, b in manifest.buckets():
                if group.backend == "nccl":
                    if group.staging is None or group.staging.numel() < b - a:
                        group.staging = torch.empty(manifest.bucket_bytes, dtype=torch.uint8,
                                                    device=torch.device("cuda", torch.cuda.current_device()))  # fmt: skip
                    view = group.staging[: b - a]
                    wait_work(group.group.broadcast(view, 0), timeout, "nccl")
                    flat[a:b] = view.cpu().numpy()
                else:
                    wait_work(group.group.broadcast(torch.from_numpy(flat[a:b]), 0), timeout, "gloo")
        except Exception as exc:
            if group.backend == "nccl":
                from .groups import abort

                abort(group.group)
            self.leave()
            self._send(_wire.BroadcastJoined(msg.group, False))
            raise RLinkError(f"broadcast of version {manifest.version} failed: {exc!r}") from exc
        return flat, where

    def _bind_host(self) -> str:
        control = self._conn.control
        return str(control.sock.getsockname()[0]) if control is not None else ""

    def leave(self) -> None:
        """Let our end of the group go (a gloo end closes once no collective of it is running)."""
        self._group = None

"""Weights by broadcast on a trusted network (``Config.weights_fanout="broadcast"``): the
learner's side.

The learner and each host's streamer (``hosts.py``) whose actor offered to (``Subscribe.broadcast``)
form a torch.distributed group of their own, built on a store the learner serves (``groups.py``):
gloo for a version in host memory, NCCL for one on a GPU. Each version's bytes then go by one
broadcast per bucket from the learner (rank 0), started as soon as the bucket is copied; its
manifest (``Broadcast``), key and Seal still travel on each member's authenticated control
connection, and the member checks every bucket's tag before it exposes the version or serves
it to its host's peers (``cast_member.py``). The bytes on the wire are not encrypted, and the
group's listeners take anyone's connection: SECURITY.md says what that exposes.

Forming: before each version goes out, and as streamers confirm one, :meth:`Caster.plan` picks
the members (and again every :data:`REPLAN_SECONDS` between versions): the open streamers that
offered, have not stalled (``membership.stalled``: behind the version they were sent and
confirming nothing for ``relay.stall_timeout``) and are not waiting out a failure. When they differ from the group's, the
group is dropped (its members take versions by stream meanwhile) and a new one formed under a
fresh random prefix: the learner sends each ``BroadcastJoin`` (store address, prefix, rank,
world, backend) and builds its own end, within :func:`~.cast_member.form_timeout`. A member that
does not come (its ready key is missing from the store) waits 1, 2, 4 ... 60 s before it is
asked again. A late joiner takes the newest version by stream as any streamer does, and joins
at the next forming.

Broadcasting runs on a thread of its own (``rlink-broadcast``), the newest version only, each
bucket's collective bounded by :func:`~.cast_member.bucket_timeout`: a dead or stopped member
never holds ``publish`` or the fan-out. When a broadcast fails the group is dropped, its members
are told to leave, and those still without the version take it by stream; the group is formed
again without whoever failed. Everything but the collectives runs under the publisher's lock.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from ..transport.session_state import SessionState
from ..wire import messages as _wire
from .cast_member import bucket_timeout, connect, form_timeout, wait_work
from .membership import stalled
from .relay import stall_timeout

__all__ = ["Caster", "backend_of"]

log = logging.getLogger(__name__)

RETRY_SECONDS = (1.0, 60.0)  # a member that failed is asked again after 1, 2, 4 ... 60 s
REPLAN_SECONDS = 1.0  # between versions, the group is looked at again this often


def backend_of(snap: Any) -> str:
    """The collective backend for a version: NCCL for one on a GPU, else gloo."""
    return "nccl" if snap is not None and str(snap.device).startswith("cuda") else "gloo"


class Caster:
    """The learner's broadcast group (rank 0) and the thread that forms it and broadcasts."""

    def __init__(self, publisher: Any):
        self.pub = publisher
        self.config = publisher.config
        self.enabled = self.config.weights_fanout == "broadcast"
        self._secret = secrets.token_hex(16)  # each group's prefix: only members learn it
        self._gen = 0  # the newest group asked for
        self._group: Any = None  # the formed group (our end), None: none
        self._members: list[int] = []  # its members' session ids, rank 1 first
        self._backend = ""
        self._want: tuple[list[int], str] | None = None  # a forming to start
        self._forming = False
        self._job: tuple[Any, int] | None = None  # the newest version to broadcast, and in which group
        self._dropped: list[Any] = []  # groups let go of, released on our thread (it may wait)
        self._store: tuple[str, Any, int] | None = None  # (address, store, port)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.stats: dict[str, Any] = {"group": 0, "members": 0, "backend": "", "formed": 0, "form_failures": 0,
                                      "versions": 0, "bytes": 0, "failures": 0, "last_error": None}  # fmt: skip

    # --- under the publisher's lock -------------------------------------------------------------
    def plan(self, sessions: dict[int, Any], backend: str) -> None:
        """Form (again) the group of the streamers that should be in it now."""
        if not self.enabled or self._closed:
            return
        now = time.monotonic()
        want = [s.id for s in sorted(sessions.values(), key=lambda s: s.id) if self._fit(s, now)]
        if self._group is not None and want == self._members and backend == self._backend:
            return
        if self._forming:
            return  # planned again once it ends
        if self._group is not None:
            self._drop("its members changed")
        if want:
            self._want, self._forming = (want, backend), True
            self._start()
            self.pub.cv.notify_all()

    def _fit(self, s: Any, now: float) -> bool:
        member = s.weights
        if not (s.state is SessionState.OPEN and member.subscribed and member.streamer and member.cast
                and not member.suspect and now >= member.cast_retry[1]):  # fmt: skip
            return False
        return not stalled(member, now, stall_timeout(self.config))

    def submit(self, snap: Any, members: list[Any]) -> None:
        """Broadcast ``snap`` to ``members`` (routed ``Route.BROADCAST``) on our thread."""
        if members:
            self._job = (snap, self._gen)
            self.pub.cv.notify_all()

    def on_joined(self, session: Any, msg: _wire.BroadcastJoined) -> None:
        """A member could not join, or left after a broadcast failed: it waits a while, and
        the group is formed again without it."""
        if not self.enabled or msg.ok or msg.group != self._gen:
            return
        self._fail(session)
        if session.id in self._members:
            self._drop(f"session {session.id} left it")

    def _fail(self, session: Any) -> None:
        member = session.weights
        failures = member.cast_retry[0] + 1
        low, high = RETRY_SECONDS
        member.cast_retry = (failures, time.monotonic() + min(high, low * 2 ** (failures - 1)))

    def _drop(self, why: str) -> None:
        """Let the group go: its members take versions by stream until the next one forms."""
        sessions = self.pub.server.sessions
        for i in self._members:
            s = sessions.get(i)
            if s is not None:
                s.weights.cast_rank = 0
                self._leave(s, self._gen)
        if self._group is not None:
            log.info("broadcast group %d dropped: %s", self._gen, why)
            self._dropped.append(self._group)
        self._group, self._members = None, []
        self.stats["members"] = 0

    def _leave(self, s: Any, group: int) -> None:
        self.pub._send([s], _wire.BroadcastJoin(group, "", 0, "", 0, 0, ""))

    def report(self) -> dict[str, Any]:
        return {**self.stats, "enabled": self.enabled}

    # --- the broadcast thread ---------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlink-broadcast", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        cv = self.pub.cv
        while True:
            with cv:
                if not self._closed and self._want is None and self._job is None and not self._dropped:
                    cv.wait(REPLAN_SECONDS)
                    latest = self.pub.latest
                    if latest is not None:  # a member may be back, or a host new, between versions
                        self.plan(self.pub.server.sessions, backend_of(latest))
                want, job, self._want, self._job = self._want, self._job, None, None
                dropped, self._dropped = self._dropped, []
            del dropped  # their end waits for a collective in flight to time out: here, not under the lock
            if self._closed:
                break
            try:
                if want is not None:
                    self._form(*want)
                if job is not None:
                    self._broadcast(*job)
            except Exception as exc:  # the thread must outlive any one failure
                log.exception("broadcast fan-out failed")
                with cv:
                    self._forming = False
                    self._drop("it failed")
                    self.stats["last_error"] = repr(exc)[:500]
        with cv:
            self._drop("the learner closes")
            self._dropped, self._store = [], None

    def _store_at(self, host: str) -> tuple[Any, int]:
        """The store our groups meet at, on the address our members reach us at."""
        if self._store is None or self._store[0] != host:
            from .groups import serve_store

            store, port = serve_store(host, form_timeout(self.config))
            self._store = (host, store, port)
        return self._store[1], self._store[2]

    def _form(self, ids: list[int], backend: str) -> None:
        pub = self.pub
        with pub.cv:
            members = [pub.server.sessions.get(i) for i in ids]
            if any(s is None or s.state is not SessionState.OPEN for s in members):
                self._forming = False
                return
            host = members[0].control.sock.getsockname()[0]  # where our members reach us
            self._gen += 1
            gen, world = self._gen, len(members) + 1
            self.stats["group"] = gen
        prefix = f"{self._secret}/{gen}/"
        group: Any = None
        try:
            from .groups import load, new_group

            load()
            store, port = self._store_at(host)
            for rank, s in enumerate(members, 1):
                pub._send([s], _wire.BroadcastJoin(gen, host, port, prefix, rank, world, backend))
            group = new_group(store, prefix, 0, world, backend=backend, hostname=host, timeout=form_timeout(self.config))
            latest = pub.latest
            connect(group, backend, latest.flat.device if latest is not None and backend == "nccl" else None,
                    form_timeout(self.config))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a member that did not come, or no store here
            if group is not None and backend == "nccl":
                from .groups import abort

                abort(group)
            missing = self._missing(prefix, len(members))
            with pub.cv:
                self._forming = False
                self.stats["form_failures"] += 1
                self.stats["last_error"] = f"forming group {gen}: {exc!r}"[:500]
                for rank, s in enumerate(members, 1):
                    self._leave(s, gen)
                    if rank in missing or not missing:
                        self._fail(s)
            log.info("broadcast group %d of %d members not formed: %s", gen, len(members), exc)
            return
        with pub.cv:
            self._forming = False
            if self._closed or gen != self._gen or any(s.state is not SessionState.OPEN for s in members):
                self._dropped.append(group)
                for s in members:
                    self._leave(s, gen)
                return
            self._group, self._members, self._backend = group, ids, backend
            newest = pub.pending or pub.latest  # its fan-out may have routed them by stream already
            first = (newest.version if newest is not None else 0) + 1
            for rank, s in enumerate(members, 1):
                s.weights.cast_rank, s.weights.cast_retry, s.weights.cast_first = rank, (0, 0.0), first
            self.stats.update(members=len(members), backend=backend)
            self.stats["formed"] += 1
            pub.cv.notify_all()

    def _missing(self, prefix: str, count: int) -> set[int]:
        """The ranks that never said they were joining (their ready key is not in the store)."""
        if self._store is None:
            return set()
        try:
            import torch.distributed as dist

            keys = dist.PrefixStore(prefix, self._store[1])  # type: ignore[attr-defined]  # from torch._C
            return {rank for rank in range(1, count + 1) if not keys.check([f"ready/{rank}"])}
        except Exception:  # noqa: BLE001 - cannot tell: every member waits a while
            return set()

    def _broadcast(self, snap: Any, gen: int) -> None:
        pub = self.pub
        sessions = pub.server.sessions
        with pub.cv:
            group, members = self._group, [sessions[i] for i in self._members if i in sessions]
            if group is None or gen != self._gen or backend_of(snap) != self._backend:
                self._fall_back(snap, "the group changed before it went out")
                return
            for s in members:
                pub._send([s], _wire.Broadcast(gen, snap.manifest))
        timeout = bucket_timeout(self.config)
        try:
            for i, (a, b) in enumerate(snap.manifest.buckets()):
                snap.wait_ready(i + 1, self.config.weights_timeout)
                wait_work(group.broadcast(_tensor(snap.flat, a, b), 0), timeout, self._backend)
        except Exception as exc:  # noqa: BLE001 - a member died, stalled or broke the group
            if self._backend == "nccl":
                from .groups import abort

                abort(group)
            with pub.cv:
                if gen == self._gen and self._group is group:
                    self._drop(f"version {snap.version}: {exc!r}")
                self.stats["failures"] += 1
                self.stats["last_error"] = f"broadcast of version {snap.version}: {exc!r}"[:500]
                self._fall_back(snap, "its broadcast failed")
            log.warning("broadcast of weights version %d failed: %s", snap.version, exc)
            return
        with pub.cv:
            self.stats["versions"] += 1
            self.stats["bytes"] += snap.manifest.total_bytes

    def _fall_back(self, snap: Any, why: str) -> None:
        """Those routed to the broadcast that still lack ``snap`` take it by stream (lock held)."""
        late = [s for s in self.pub.server.sessions.values() if s.state is SessionState.OPEN and s.weights.streamer
                and s.weights.cast and s.weights.sent >= snap.version > s.weights.acked]  # fmt: skip
        log.info("weights version %d: %s; %d members take it by stream", snap.version, why, len(late))
        self.pub._send(late, _wire.Version(snap.version))

    def close(self) -> None:
        with self.pub.cv:
            self._closed = True
            self.pub.cv.notify_all()
        if self._thread is not None:
            self._thread.join(self.config.close_timeout)


def _tensor(flat: Any, a: int, b: int) -> Any:
    """Bytes ``a:b`` of a version's buffer as a tensor (a host buffer's numpy view, shared)."""
    if hasattr(flat, "__array_interface__"):
        import torch

        return torch.from_numpy(flat[a:b])
    return flat[a:b]

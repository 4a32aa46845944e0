"""The broadcast fan-out on trusted networks (``weights/broadcast.py``, ``weights/cast_member.py``):
which streamers the learner's group holds and when it is formed again, and, in one process
over loopback with gloo, forming a group, a version broadcast bucket by bucket, a member that
never comes, and a member that stalls in the middle of a version."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rlink_ucx.config import Config
from rlink_ucx.transport.session_state import SessionState
from rlink_ucx.weights.broadcast import Caster, backend_of
from rlink_ucx.weights.cast_member import CastLink
from rlink_ucx.weights.membership import Membership
from rlink_ucx.weights.route import Route, delivery
from rlink_ucx.weights.snapshot import BufferPool, snapshot
from rlink_ucx.wire import messages as _wire

KEY = b"k" * 32


def session(sid: int, **fields: Any) -> SimpleNamespace:
    member = Membership(**{"subscribed": True, "peers": True, "streamer": True, "cast": True, "key": KEY,
                           "host": f"h{sid}", **fields})
    sock = SimpleNamespace(getsockname=lambda: ("127.0.0.1", 1))
    return SimpleNamespace(id=sid, state=SessionState.OPEN, weights=member, control=SimpleNamespace(sock=sock))


class Pub:
    """The publisher as the caster sees it: its lock, sessions, newest version and sends."""

    def __init__(self, config: Config, sessions: list[Any]):
        self.config = config
        self.cv = threading.Condition()
        self.server = SimpleNamespace(sessions={s.id: s for s in sessions})
        self.latest: Any = None
        self.pending: Any = None
        self.sent: list[tuple[int, Any]] = []
        self.inboxes: dict[int, queue.SimpleQueue[Any]] = {s.id: queue.SimpleQueue() for s in sessions}

    def _send(self, sessions: list[Any], *msgs: Any) -> None:
        for s in sessions:
            for msg in msgs:
                self.sent.append((s.id, msg))
                self.inboxes.setdefault(s.id, queue.SimpleQueue()).put(msg)


def locked(pub: Pub, call: Any, *args: Any) -> None:
    """As the publisher calls the caster: under its lock."""
    with pub.cv:
        call(*args)


def config(**kw: Any) -> Config:
    return Config(weights_fanout="broadcast", **kw)


@pytest.fixture
def no_thread(monkeypatch):
    monkeypatch.setattr(Caster, "_start", lambda self: None)


def test_a_broadcast_member_takes_versions_by_broadcast_and_its_peers_from_it():
    assert delivery(Membership(subscribed=True, peers=True, streamer=True, key=KEY, cast_rank=1), None) is Route.BROADCAST
    assert delivery(Membership(subscribed=True, peers=True, streamer=True, key=KEY, cast_rank=2, relay_from=3),
                    None) is Route.BROADCAST  # fmt: skip
    assert delivery(Membership(subscribed=True, peers=True, key=KEY, cast_rank=1), None) is Route.FROM_PEER
    assert backend_of(SimpleNamespace(device="cuda:0")) == "nccl" and backend_of(SimpleNamespace(device="cpu")) == "gloo"


def test_the_relay_setting_never_forms_a_group(no_thread):
    pub = Pub(Config(weights_fanout="relay"), [session(1), session(2)])
    caster = Caster(pub)
    locked(pub, caster.plan, pub.server.sessions, "gloo")
    assert caster._want is None and not pub.sent


def test_the_group_holds_the_streamers_that_offered_and_are_caught_up(no_thread):
    sessions = [session(3), session(1), session(2, suspect=True), session(4, cast=False), session(5),
                session(6, cast_retry=(1, time.monotonic() + 60)), session(7, sent=3, acked=2)]  # fmt: skip
    sessions[4].state = SessionState.CLOSED
    pub = Pub(config(), sessions)
    caster = Caster(pub)
    locked(pub, caster.plan, pub.server.sessions, "gloo")
    assert caster._want == ([1, 3, 7], "gloo")  # 7 is behind, but not for stall_timeout yet
    caster._want, caster._forming = None, False
    pub.server.sessions[7].weights.behind = (time.monotonic() - 60, 2)  # behind for a minute, confirming nothing
    locked(pub, caster.plan, pub.server.sessions, "gloo")
    assert caster._want == ([1, 3], "gloo")


def test_a_new_host_or_a_member_gone_forms_the_group_again(no_thread):
    sessions = [session(1), session(2)]
    pub = Pub(config(), sessions)
    caster = Caster(pub)
    caster._group, caster._members, caster._backend, caster._gen = object(), [1, 2], "gloo", 4
    for rank, s in enumerate(sessions, 1):
        s.weights.cast_rank = rank
    locked(pub, caster.plan, pub.server.sessions, "gloo")
    assert caster._want is None and not pub.sent  # unchanged: kept
    pub.server.sessions[9] = session(9)
    locked(pub, caster.plan, pub.server.sessions, "gloo")
    assert caster._want == ([1, 2, 9], "gloo") and caster._group is None and len(caster._dropped) == 1
    assert all(s.weights.cast_rank == 0 for s in sessions)  # by stream until it forms
    leaves = [(i, m) for i, m in pub.sent if isinstance(m, _wire.BroadcastJoin)]
    assert sorted(i for i, _ in leaves) == [1, 2] and all(m.world == 0 and m.group == 4 for _, m in leaves)
    # a CUDA version: the group is formed again on NCCL
    caster._want, caster._forming = None, False
    caster._group, caster._members = object(), [1, 2, 9]
    locked(pub, caster.plan, pub.server.sessions, "nccl")
    assert caster._want == ([1, 2, 9], "nccl")


def test_a_member_that_could_not_join_waits_before_it_is_asked_again(no_thread):
    sessions = [session(1), session(2)]
    pub = Pub(config(), sessions)
    caster = Caster(pub)
    caster._group, caster._members, caster._gen = object(), [1, 2], 3
    caster.on_joined(sessions[1], _wire.BroadcastJoined(2, False))  # an older group's: ignored
    assert caster._group is not None
    locked(pub, caster.on_joined, sessions[1], _wire.BroadcastJoined(3, False))
    assert caster._group is None and sessions[1].weights.cast_retry[0] == 1
    assert 0.5 < sessions[1].weights.cast_retry[1] - time.monotonic() <= 1.0
    locked(pub, caster.plan, pub.server.sessions, "gloo")
    assert caster._want == ([1], "gloo")


class Member:
    """An actor's end of the group on a thread: joins when told, takes each Broadcast."""

    def __init__(self, pub: Pub, sid: int, cfg: Config):
        self.inbox = pub.inboxes[sid]
        conn = SimpleNamespace(control=SimpleNamespace(sock=SimpleNamespace(getsockname=lambda: ("127.0.0.1", 1))))
        self.replies: list[Any] = []
        self.link = CastLink(cfg, conn, self.replies.append)
        self.got: dict[int, bytes] = {}
        self.errors: list[Exception] = []
        self.stall = threading.Event()
        self.stop = False
        self._pool = BufferPool()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            try:
                msg = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(msg, _wire.BroadcastJoin):
                self.link.join(msg)
            elif isinstance(msg, _wire.Broadcast):
                if self.stall.is_set():
                    continue
                try:
                    flat, _ = self.link.take(msg, self._pool)  # type: ignore[misc]
                    self.got[msg.version] = bytes(flat)
                except Exception as exc:  # noqa: BLE001 - recorded for the test
                    self.errors.append(exc)


def _until(check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_group_forms_over_loopback_and_each_version_goes_bucket_by_bucket():
    pytest.importorskip("torch.distributed")
    cfg = config(weights_timeout=3.0)
    sessions = [session(1), session(2)]
    pub = Pub(cfg, sessions)
    members = [Member(pub, s.id, cfg) for s in sessions]
    caster = Caster(pub)
    try:
        with pub.cv:
            caster.plan(pub.server.sessions, "gloo")
        _until(lambda: caster.stats["members"] == 2, 30)
        assert [s.weights.cast_rank for s in sessions] == [1, 2]
        assert [s.weights.cast_first for s in sessions] == [1, 1]  # nothing published before it formed
        _until(lambda: all(m.replies for m in members), 10)  # each says so once its end is built
        assert all(m.replies == [_wire.BroadcastJoined(1, True)] for m in members)
        state = {"w": np.arange(300_000, dtype=np.float32), "b": np.ones(7, np.int64)}
        snap = snapshot(state, 1, 64 << 10, BufferPool())  # 19 buckets
        with pub.cv:
            caster.submit(snap, sessions)
        _until(lambda: all(1 in m.got for m in members), 20)
        assert all(m.got[1] == bytes(snap.flat) for m in members)
        assert caster.stats["versions"] == 1 and caster.stats["bytes"] == snap.manifest.total_bytes

        # A member that stalls in the middle of a version: the broadcast times out, the group
        # is dropped, and the members without the version are told to take it by stream.
        members[1].stall.set()
        big = snapshot({"w": np.full(8 << 20, 2, np.uint8)}, 2, 32 << 20, BufferPool())
        for s in sessions:
            s.weights.sent, s.weights.acked = 2, 1
        started = time.monotonic()
        with pub.cv:
            caster.submit(big, sessions)
        _until(lambda: caster.stats["failures"] == 1, 20)
        assert time.monotonic() - started < 10
        assert caster._group is None and all(s.weights.cast_rank == 0 for s in sessions)
        told = [i for i, m in pub.sent if isinstance(m, _wire.Version) and m.version == 2]
        assert sorted(told) == [1, 2], pub.sent[-6:]
    finally:
        caster.close()
        for m in members:
            m.stop = True


@pytest.mark.timeout(60)
def test_a_member_that_never_comes_is_left_out_for_a_while():
    pytest.importorskip("torch.distributed")
    cfg = config(weights_timeout=2.0)  # forming may take 1 s
    sessions = [session(1), session(2)]
    pub = Pub(cfg, sessions)
    members = [Member(pub, 1, cfg)]  # session 2's actor never reads its BroadcastJoin
    caster = Caster(pub)
    try:
        with pub.cv:
            caster.plan(pub.server.sessions, "gloo")
        _until(lambda: caster.stats["form_failures"] == 1, 30)
        assert sessions[1].weights.cast_retry[1] > time.monotonic() and sessions[0].weights.cast_retry == (0, 0.0)
        with pub.cv:
            pub.latest = SimpleNamespace(device="cpu", version=1)  # the thread plans again between versions
        _until(lambda: caster.stats["members"] == 1, 30)  # without the absent one
        assert sessions[0].weights.cast_rank == 1 and sessions[1].weights.cast_rank == 0
    finally:
        caster.close()
        for m in members:
            m.stop = True


def test_an_actor_that_did_not_opt_in_never_joins():
    replies: list[Any] = []
    conn = SimpleNamespace(control=None)
    link = CastLink(Config(weights_fanout="relay"), conn, replies.append)
    link.join(_wire.BroadcastJoin(3, "127.0.0.1", 9, "p/", 1, 2, "gloo"))
    assert not link.active and replies == [_wire.BroadcastJoined(3, False)]


def test_a_learner_without_the_setting_ignores_broadcast_replies(no_thread):
    sessions = [session(1)]
    pub = Pub(Config(weights_fanout="relay"), sessions)
    caster = Caster(pub)
    locked(pub, caster.on_joined, sessions[0], _wire.BroadcastJoined(0, False))
    assert sessions[0].weights.cast_retry == (0, 0.0)

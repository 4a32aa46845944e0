"""A pump's burst of whole small frames from many sessions, landed at once
(``session/learner/burst.py``, ``StepRing.land_many``, ``Pump.land_burst``): a burst that mixes
good frames with bad ones (bad length, bad sequence, a frame of another session, a truncated
frame) ends only the sessions that sent a bad one, and every good frame lands exactly once."""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
import types

import numpy as np
import pytest

from rlink_ucx import Config, ProtocolError
from rlink_ucx.observe.ratelog import RateLimitedLog
from rlink_ucx.session.learner.burst import land_burst
from rlink_ucx.session.learner.session import LearnerSession
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.codec import Schema
from rlink_ucx.wire.frame import FrameHeader

pytestmark = pytest.mark.timeout(60)

SCHEMA = Schema.from_spec({"obs": ("float32", (2,)), "seq": ("int64", ())})
STEP = SCHEMA.step_bytes  # 8 + 8


class _Session(LearnerSession):
    """A session whose failures are recorded (no I/O loop to hand them to)."""

    def fail_threadsafe(self, exc: BaseException) -> None:
        self.failures.append(exc)
        self.failed_event.set()


def _sessions(actors: list[int], credit: int = 1000) -> tuple[dict[int, _Session], StepRing]:
    """Sessions of ``actors`` (actor id = incarnation = the key) landing in one ring."""
    ring = StepRing(SCHEMA, 1024 * STEP, 4, chunk_steps=8)
    server = types.SimpleNamespace(config=Config(), grant_credits=lambda: None, session_ended=lambda *a: None,
                                   credit_low=lambda: None, quiet_log=RateLimitedLog(logging.getLogger("test")),
                                   token=None, loop=None)  # fmt: skip
    control = types.SimpleNamespace(last_send=0.0, send=lambda msg: None, close=lambda: None)
    out = {}
    for actor in actors:
        hello = _wire.Hello(actor, actor, "0", "tcp", False, "h", 1)
        session = _Session(server, actor, control, hello, actor, "tcp", "test", b"t" * 32)  # type: ignore[arg-type]
        session.schema_id, session.ring, session.flow.credit, session.flow.low_water = 1, ring, credit, -1
        session.failures, session.failed_event = [], threading.Event()  # type: ignore[attr-defined]
        out[actor] = session
    return out, ring


def _payload(actor: int, seq: int, n: int = 1) -> bytes:
    """Each step's values name its actor and seq, so every landed step can be traced back."""
    seqs = np.arange(seq, seq + n)
    obs = np.stack([np.full(n, actor, np.float32), seqs.astype(np.float32)], axis=1)
    return obs.tobytes() + seqs.astype(np.int64).tobytes()


def _frame(actor: int, seq: int, n: int = 1, **overrides: int) -> tuple[bytes, bytes]:
    payload = _payload(actor, seq, n)
    fields = {"schema_id": 1, "n_steps": n, "actor_id": actor, "incarnation": actor, "seq": seq, "version": 0,
              "payload_bytes": len(payload)}  # fmt: skip
    fields.update(overrides)
    return FrameHeader(**fields).pack(), payload  # type: ignore[arg-type]


def _landed(ring: StepRing) -> collections.Counter[tuple[int, int]]:
    """Every step the ring holds, as (actor, seq), checked against its own bytes."""
    ready = ring.ready_steps()
    if not ready:
        return collections.Counter()
    pieces, take_id = ring.take(ready, 1.0)
    out: collections.Counter[tuple[int, int]] = collections.Counter()
    for piece in pieces:
        obs = np.frombuffer(ring.piece_bytes(0, piece).tobytes(), np.float32).reshape(piece.count, 2)
        seqs = np.frombuffer(ring.piece_bytes(1, piece).tobytes(), np.int64)
        assert list(seqs) == list(range(piece.seq, piece.seq + piece.count))
        assert (obs[:, 0] == piece.actor_id).all() and list(obs[:, 1]) == list(seqs.astype(np.float32))
        out.update((piece.actor_id, int(s)) for s in seqs)
    ring.release(take_id)
    return out


def _mixed_burst() -> list[tuple[int, bytes, bytes]]:
    """(session, header, payload) of a burst: actors 1, 5 and 6 are good throughout; 2 sends a
    bad length after a good frame, 3 a bad sequence, 4 a frame claiming actor 9 (another
    session's), 7 a truncated frame (fewer payload bytes than its header announces)."""
    burst = []
    def add(session: int, frame: tuple[bytes, bytes]) -> None:
        burst.append((session, *frame))
    add(1, _frame(1, 0, 2))
    add(2, _frame(2, 0))
    add(3, _frame(3, 5))  # expected seq 0
    add(5, _frame(5, 0))
    add(2, _frame(2, 1, payload_bytes=3 * STEP))  # one step, three steps' worth announced
    add(1, _frame(1, 2))
    add(4, _frame(4, 0, actor_id=9, incarnation=9))
    add(6, _frame(6, 0, 3))
    header, payload = _frame(7, 0, 2)
    add(7, (header, payload[: STEP + 3]))
    add(2, _frame(2, 1))  # good on its own, but after its session's bad frame: never landed
    add(3, _frame(3, 0))  # the same: its session already failed
    add(5, _frame(5, 1))
    add(6, _frame(6, 3))
    add(1, _frame(1, 3, 4))
    return burst


GOOD = collections.Counter([(1, s) for s in range(7)] + [(2, 0)] + [(5, 0), (5, 1)] + [(6, s) for s in range(4)])


def test_a_mixed_burst_ends_only_the_bad_sessions_and_lands_every_good_frame_once():
    sessions, ring = _sessions([1, 2, 3, 4, 5, 6, 7])
    frames = [(sessions[s], memoryview(h), memoryview(p)) for s, h, p in _mixed_burst()]
    failed = dict(land_burst(frames))  # type: ignore[arg-type]
    assert {s.actor_id for s in failed} == {2, 3, 4, 7}
    assert all(isinstance(exc, ProtocolError) for exc in failed.values())
    assert "3 steps" in str(failed[sessions[2]]) or "payload" in str(failed[sessions[2]])
    assert "seq 5, expected 0" in str(failed[sessions[3]])
    assert "claims actor 9/9" in str(failed[sessions[4]])
    assert "came with" in str(failed[sessions[7]])
    assert _landed(ring) == GOOD
    assert ring.stats.frames_in == 8 and ring.stats.steps_in == sum(GOOD.values())
    next_seq = {a: s.next_seq for a, s in sessions.items()}
    assert next_seq == {1: 7, 2: 1, 3: 0, 4: 0, 5: 2, 6: 4, 7: 0}
    assert sessions[1].flow.credit == 1000 - 7 and sessions[2].flow.credit == 999 and sessions[3].flow.credit == 1000
    assert sessions[1].stats.frames == 3 and sessions[6].stats.steps == 4


def test_a_resent_frame_in_a_burst_is_dropped_and_counted_not_landed_twice():
    sessions, ring = _sessions([1])
    s = sessions[1]
    frames = [_frame(1, 0, 2), _frame(1, 0, 2), _frame(1, 2)]  # the second: resent after a reconnect
    assert land_burst([(s, memoryview(h), memoryview(p)) for h, p in frames]) == []  # type: ignore[list-item]
    assert _landed(ring) == collections.Counter({(1, 0): 1, (1, 1): 1, (1, 2): 1})
    assert s.stats.duplicate_steps == 2 and s.next_seq == 3


def test_land_many_refuses_only_the_frames_the_ring_cannot_take():
    ring = StepRing(SCHEMA, 64 * STEP, 4, chunk_steps=8)
    frames = [(1, 1, 0, 0, 0.0, memoryview(_payload(1, 0))), (9, 2, 0, 0, 0.0, memoryview(_payload(2, 0, 9))),
              (1, 3, 0, 0, 0.0, memoryview(_payload(3, 0)[:5])), (2, 4, 0, 0, 0.0, memoryview(_payload(4, 0, 2)))]  # fmt: skip
    refused = ring.land_many(frames)
    assert [i for i, _ in refused] == [1, 2]
    assert "9 steps" in str(refused[0][1]) and "bytes of payload" in str(refused[1][1])
    assert _landed(ring) == collections.Counter({(1, 0): 1, (4, 0): 1, (4, 1): 1})


# --- through real sockets and a pump ----------------------------------------------------------
def _wait(until: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_a_pumped_mixed_burst_over_tcp_ends_only_the_bad_connections():
    from rlink_ucx.transport.tcp.stream import TcpReceiver

    actors = [1, 2, 3, 4, 5, 6, 7]
    sessions, ring = _sessions(actors)
    listener = socket.create_server(("127.0.0.1", 0))
    clients, receivers = {}, {}
    try:
        for actor in actors:
            clients[actor] = socket.create_connection(listener.getsockname())
            sock, _ = listener.accept()
            receivers[actor] = TcpReceiver(sock, sessions[actor])
            sessions[actor].receiver = receivers[actor]
        wire: dict[int, bytes] = collections.defaultdict(bytes)
        for s, h, p in _mixed_burst():
            if s != 7:
                wire[s] += h + p
        for actor, data in wire.items():  # all sent before the pump starts: one pass reads them all
            clients[actor].sendall(data)
        header, payload = _frame(7, 0, 2)
        clients[7].sendall(header + payload[: STEP + 3])  # truncated: the connection then closes
        clients[7].close()
        time.sleep(0.2)
        for receiver in receivers.values():
            receiver.start()
        bad = [2, 3, 4, 7]
        _wait(lambda: all(sessions[a].failed_event.is_set() for a in bad) and ring.ready_steps() >= sum(GOOD.values()))
        time.sleep(0.1)  # anything landing late would show below
        assert {a for a in actors if sessions[a].failures} == set(bad)
        assert isinstance(sessions[7].failures[0], ConnectionResetError)  # mid-frame
        for a in (2, 3, 4):
            assert isinstance(sessions[a].failures[0], ProtocolError)
        assert _landed(ring) == GOOD
        assert ring.stats.torn_frames == 1  # actor 7's frame, begun and never completed
    finally:
        for c in clients.values():
            c.close()
        for r in receivers.values():
            r.close()
        listener.close()
        ring.close()


@pytest.mark.parametrize("many", [False, True])
def test_a_frame_landed_around_a_frame_still_arriving_goes_to_its_own_positions(many):
    """The free space after the cursor is two runs, around a frame still arriving: a whole
    frame landed there is written to those runs, not over the other frame's steps."""
    schema = Schema.from_spec({"x": ("int64", ())})
    ring = StepRing(schema, 64 * 8, 4, chunk_steps=8)

    def data(*values: int) -> memoryview:
        return memoryview(np.array(values, np.int64).tobytes())

    def drain(count: int) -> None:
        _, take = ring.take(count, 1.0)
        ring.release(take)

    ring.land(2, 1, 0, 0, 0.0, data(10, 11))  # positions 0-1
    arriving = ring.reserve(2, 2, 0, 0)  # positions 2-3, its bytes still on their way
    drain(2)
    seq = 0
    while ring._space.head >= 4:  # frames come and go until the cursor wraps to position 0
        ring.land(4, 3, seq, 0, 0.0, data(*range(100 + seq, 104 + seq)))
        drain(4)
        seq += 4
    assert ring._space.head == 0 and ring._space._free.extents()[0] == (0, 2)
    if many:
        assert ring.land_many([(4, 5, 0, 0, 0.0, data(50, 51, 52, 53))]) == []
    else:
        ring.land(4, 5, 0, 0, 0.0, data(50, 51, 52, 53))  # in positions 0-1 and 4-5
    for view in ring.field_views(arriving)[0]:
        view[:] = np.array([20, 21], np.int64).tobytes()
    ring.commit(arriving)
    pieces, take = ring.take(6, 1.0)
    got: dict[int, list[int]] = {}
    for piece in pieces:
        got.setdefault(piece.actor_id, []).extend(np.frombuffer(ring.piece_bytes(0, piece).tobytes(), np.int64).tolist())
    ring.release(take)
    assert got == {5: [50, 51, 52, 53], 2: [20, 21]}

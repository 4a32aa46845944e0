"""A whole small frame in hand lands in one call (``LearnerSession.land`` -> ``StepRing.land``):
the same bytes, checks, counts and credit as ``begin`` + copy + ``end_threadsafe``, and a tcp
receiver reading small frames into its scratch buffer uses it for every frame that came whole."""

from __future__ import annotations

import logging
import socket
import types

import numpy as np
import pytest

from rlink_ucx import Config, ProtocolError
from rlink_ucx.observe.ratelog import RateLimitedLog
from rlink_ucx.session.learner.session import LearnerSession
from rlink_ucx.store.ring import StepRing
from rlink_ucx.transport.tcp.stream import TcpReceiver
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.codec import Schema
from rlink_ucx.wire.frame import FRAME_HEADER_BYTES, FrameHeader, announced_payload

pytestmark = pytest.mark.timeout(60)

SCHEMA = Schema.from_spec({"obs": ("float32", (4,)), "seq": ("int64", ()), "done": ("bool", ())})
STEP = SCHEMA.step_bytes  # 16 + 8 + 1


def _session(credit: int = 1000, chunk_steps: int = 8) -> tuple[LearnerSession, StepRing]:
    ring = StepRing(SCHEMA, 64 * STEP, 4, chunk_steps=chunk_steps)
    server = types.SimpleNamespace(config=Config(), grant_credits=lambda: None, session_ended=lambda *a: None,
                                   credit_low=lambda: None, quiet_log=RateLimitedLog(logging.getLogger("test")),
                                   token=None, loop=None)  # fmt: skip
    hello = _wire.Hello(7, 11, "0", "tcp", False, "h", 1)
    control = types.SimpleNamespace(last_send=0.0, send=lambda msg: None, close=lambda: None)  # sends go nowhere
    session = LearnerSession(server, 1, control, hello, 7, "tcp", "test", b"t" * 32)  # type: ignore[arg-type]
    session.schema_id, session.ring, session.flow.credit, session.flow.low_water = 1, ring, credit, -1
    return session, ring


def _steps(first_seq: int, n: int) -> dict[str, np.ndarray]:
    seqs = np.arange(first_seq, first_seq + n)
    return {"obs": np.stack([seqs * 1.5 + j for j in range(4)], axis=1).astype(np.float32),
            "seq": seqs.astype(np.int64), "done": (seqs % 3 == 0)}  # fmt: skip


def _frame(seq: int, n: int, **overrides: int) -> tuple[bytes, bytes]:
    """A frame's header and payload (each field's bytes for the n steps, one field after another)."""
    steps = _steps(seq, n)
    payload = b"".join(np.ascontiguousarray(steps[f.name]).tobytes() for f in SCHEMA.fields)
    fields = {"schema_id": 1, "n_steps": n, "actor_id": 7, "incarnation": 11, "seq": seq, "version": 0, "payload_bytes": len(payload)}
    fields.update(overrides)
    return FrameHeader(**fields).pack(), payload  # type: ignore[arg-type]


def _taken(ring: StepRing, count: int) -> dict[str, np.ndarray]:
    """The next ``count`` steps of the ring, as typed arrays (and releases them)."""
    pieces, take_id = ring.take(count, 1.0)
    out = {}
    for f, spec in enumerate(SCHEMA.fields):
        raw = b"".join(ring.piece_bytes(f, p).tobytes() for p in pieces)
        out[spec.name] = np.frombuffer(raw, dtype=spec.dtype).reshape(count, *spec.shape)
    ring.release(take_id)
    return out


def test_a_landed_frame_is_what_begin_copy_end_would_have_put_in_the_ring():
    landed, ring_a = _session()
    begun, ring_b = _session()
    for seq, n in [(0, 3), (3, 1), (4, 4)]:
        header, payload = _frame(seq, n)
        landed.land(memoryview(header), memoryview(payload))
        views = begun.begin(header)
        at = 0
        for v in views:
            v[:] = payload[at : at + len(v)]
            at += len(v)
        begun.end_threadsafe()
    a, b = _taken(ring_a, 8), _taken(ring_b, 8)
    want = _steps(0, 8)
    for name in want:
        np.testing.assert_array_equal(a[name], want[name])
        np.testing.assert_array_equal(b[name], want[name])
    assert (landed.flow.credit, landed.next_seq, landed.stats.frames, landed.stats.steps, landed.stats.bytes) == (
        992, 8, 3, 8, 8 * STEP)
    assert (begun.flow.credit, begun.next_seq, begun.stats.frames, begun.stats.steps) == (992, 8, 3, 8)
    assert ring_a.stats.frames_in == ring_b.stats.frames_in == 3


def test_a_frame_that_crosses_a_ring_chunk_lands_in_both():
    session, ring = _session(chunk_steps=4)
    for seq, n in [(0, 3), (3, 3)]:  # the second: one step in the first chunk, two in the next
        session.land(*map(memoryview, _frame(seq, n)))
    got = _taken(ring, 6)
    want = _steps(0, 6)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_a_payload_in_one_part_per_field_or_in_other_pieces_lands_the_same():
    session, ring = _session()
    header, payload = _frame(0, 2)
    per_field = [memoryview(payload)[0:32], memoryview(payload)[32:48], memoryview(payload)[48:50]]
    session.land(memoryview(header), per_field)
    header, payload = _frame(2, 2)
    session.land(memoryview(header), [memoryview(payload)[:7], memoryview(payload)[7:]])  # not by field: joined
    got = _taken(ring, 4)
    want = _steps(0, 4)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    header, payload = _frame(4, 2)
    with pytest.raises(ProtocolError, match="2 steps with 49 bytes"):
        session.land(memoryview(header), [memoryview(payload)[:-1]])  # a byte short
    assert (session.next_seq, ring.used) == (4, 0)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"first": 5}, "expected 0"),
        ({"payload_bytes": 2 * STEP + 1}, "does not match"),
        ({"actor_id": 8}, "claims actor 8"),
        ({"schema_id": 2}, "schema id 2"),
    ],
)
def test_a_refused_frame_leaves_the_session_and_the_ring_as_they_were(overrides, match):
    session, ring = _session(credit=10)
    header, payload = _frame(overrides.pop("first", 0), 2, **overrides)
    with pytest.raises(ProtocolError, match=match):
        session.land(memoryview(header), memoryview(payload))
    assert (session.flow.credit, session.next_seq, session.stats.frames, ring.used, ring.stats.frames_in) == (10, 0, 0, 0, 0)


def test_a_frame_beyond_the_credit_is_refused():
    session, ring = _session(credit=1)
    with pytest.raises(ProtocolError, match="exceeds the 1 steps of credit"):
        session.land(*map(memoryview, _frame(0, 2)))
    assert (session.flow.credit, ring.used) == (1, 0)


def test_a_resent_frame_already_delivered_is_counted_as_duplicate_and_not_landed():
    session, ring = _session()
    session.land(*map(memoryview, _frame(0, 2)))
    session.resumed = True
    session.land(*map(memoryview, _frame(0, 2)))  # a reconnect resent it
    assert (session.stats.duplicate_steps, session.stats.frames, ring.used, session.next_seq) == (2, 1, 2, 2)


def test_announced_payload_reads_the_header_s_payload_size():
    header, payload = _frame(0, 3)
    assert announced_payload(header) == len(payload) == 3 * STEP
    assert announced_payload(b"x" * 5 + header, 5) == 3 * STEP


class _BothSink:
    """A sink with ``land`` and ``begin``/``end``: records which way each frame came."""

    def __init__(self) -> None:
        self.ways: list[tuple[str, int, bytes]] = []
        self._open: tuple[int, bytearray] | None = None

    def land(self, header: memoryview, payload: memoryview) -> None:
        self.ways.append(("land", FrameHeader.unpack(header).seq, bytes(payload)))

    def begin(self, header: bytes) -> list[memoryview]:
        h = FrameHeader.unpack(header)
        self._open = (h.seq, bytearray(h.payload_bytes))
        return [memoryview(self._open[1])]

    def end_threadsafe(self) -> None:
        assert self._open is not None
        self.ways.append(("begin", self._open[0], bytes(self._open[1])))

    def abandon(self) -> None:
        pass

    def fail_threadsafe(self, exc: BaseException) -> None:
        raise AssertionError(f"unexpected failure: {exc!r}")


def test_a_pumped_tcp_receiver_lands_whole_frames_and_begins_those_cut_by_the_read():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    listener.close()
    try:
        sink = _BothSink()
        receiver = TcpReceiver(accepted, sink)
        frames = [_frame(seq, 1) for seq in range(4)]
        wire = b"".join(h + p for h, p in frames)
        cut = 3 * (FRAME_HEADER_BYTES + STEP) - 5  # the third frame's payload is cut by the first read
        for part in (wire[:cut], wire[cut:]):
            client.sendall(part)
            got = 0
            while got < len(part):  # loopback: what was sent is readable at once
                got = len(accepted.recv(len(part), socket.MSG_PEEK))
            receiver.pump_step()
        assert [(way, seq) for way, seq, _ in sink.ways] == [("land", 0), ("land", 1), ("begin", 2), ("land", 3)]
        assert [payload for _, _, payload in sink.ways] == [p for _, p in frames]
    finally:
        client.close()
        accepted.close()

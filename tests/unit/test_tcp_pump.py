"""The tcp receiver read by a pump (``transport/pump.py``): frames that arrive in pieces, many
frames in one read, a connection that closes mid-header or mid-frame, and errors surfacing to
the session. Real loopback sockets, one process, no learner; ``pump_step`` is also driven by
hand so each state is checked where the read stopped."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from rlink_ucx.errors import ProtocolError
from rlink_ucx.transport import pump
from rlink_ucx.transport.tcp.stream import _SCRATCH_BYTES, TcpReceiver
from rlink_ucx.wire.frame import FRAME_HEADER_BYTES, FrameHeader

pytestmark = pytest.mark.timeout(60)


class _Sink:
    """Keeps each frame's payload (in two views, so a payload is split across them); records
    completions, failures and abandons. ``refuse_seq``: ``begin`` raises for that frame."""

    def __init__(self, refuse_seq: int | None = None) -> None:
        self.frames: list[bytearray] = []
        self.seqs: list[int] = []
        self.ended = 0
        self.failed: list[BaseException] = []
        self.abandoned = threading.Event()
        self.done = threading.Semaphore(0)
        self.refuse_seq = refuse_seq

    def begin(self, header: bytes) -> list[memoryview]:
        h = FrameHeader.unpack(header)
        if h.seq == self.refuse_seq:
            raise ProtocolError(f"frame seq {h.seq} refused")
        self.seqs.append(h.seq)
        self.frames.append(bytearray(h.payload_bytes))
        view = memoryview(self.frames[-1])
        half = h.payload_bytes // 3
        return [view[:half], view[half:]]

    def end_threadsafe(self) -> None:
        self.ended += 1
        self.done.release()

    def abandon(self) -> None:
        self.abandoned.set()

    def fail_threadsafe(self, exc: BaseException) -> None:
        self.failed.append(exc)
        self.done.release()


def _wire(seq: int, payload: bytes) -> bytes:
    return FrameHeader(1, 1, 7, 0, seq, 0, len(payload)).pack() + payload


def _payloads(sizes: list[int], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def _arrived(sock: socket.socket, n: int) -> None:
    """Until ``n`` bytes wait in ``sock``'s receive queue (loopback delivers at once; bounded)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if len(sock.recv(n, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= n:
                return
        except BlockingIOError:
            pass
        time.sleep(0.005)
    raise AssertionError(f"{n} bytes never arrived")


def test_pump_step_resumes_a_header_and_a_payload_cut_anywhere(connection):
    # Driven by hand: each piece is read by one pump_step, which must stop where the bytes do
    # and go on from there with the next piece.
    client, accepted = connection
    sink = _Sink()
    receiver = TcpReceiver(accepted, sink)
    payload = _payloads([1000])[0]
    wire = _wire(0, payload) + _wire(1, payload[:10])
    cuts = [5, FRAME_HEADER_BYTES - 1, FRAME_HEADER_BYTES + 200, FRAME_HEADER_BYTES + 999, len(wire) - 3, len(wire)]
    states = []
    start = 0
    for cut in cuts:
        client.sendall(wire[start:cut])
        _arrived(accepted, cut - start)
        start = cut
        receiver.pump_step()
        states.append((receiver._got, receiver._left, sink.ended))
    assert states == [
        (5, 0, 0),  # mid-header
        (FRAME_HEADER_BYTES - 1, 0, 0),  # one byte short of the header
        (0, 800, 0),  # the header, and 200 of 1,000 payload bytes (across the sink's two views)
        (0, 1, 0),  # one byte short of the payload
        (0, 3, 1),  # that byte, the next header and 7 of its 10 payload bytes, in one read
        (0, 0, 2),
    ]
    assert sink.seqs == [0, 1]
    assert bytes(sink.frames[0]) == payload and bytes(sink.frames[1]) == payload[:10]
    assert not sink.failed


def test_many_small_frames_in_one_read_are_all_handled_by_one_pump_step(connection):
    # A lockstep burst: what one system call brings is parsed whole, not a frame per wake-up.
    client, accepted = connection
    sink = _Sink()
    receiver = TcpReceiver(accepted, sink)
    payloads = _payloads([36 + i % 7 for i in range(200)])
    wire = b"".join(_wire(i, p) for i, p in enumerate(payloads))
    assert len(wire) < _SCRATCH_BYTES
    client.sendall(wire)
    _arrived(accepted, len(wire))
    receiver.pump_step()
    assert sink.ended == 200
    assert sink.seqs == list(range(200))
    assert [bytes(f) for f in sink.frames] == payloads
    assert (receiver._got, receiver._left) == (0, 0)


def test_after_a_large_frame_only_the_next_header_is_read_ahead(connection):
    # A large frame's payload goes straight into the sink; reading the next frames into the
    # scratch buffer would copy up to a scratch buffer of the next large payload twice.
    client, accepted = connection
    sink = _Sink()
    receiver = TcpReceiver(accepted, sink)
    big, small = _payloads([_SCRATCH_BYTES + 40_000, 40], seed=3)
    wire = _wire(0, big) + _wire(1, small)
    client.sendall(wire)
    _arrived(accepted, len(wire))
    states = []
    for _ in range(3):
        receiver.pump_step()
        states.append((sink.ended, receiver._left))
    first_read = _SCRATCH_BYTES - FRAME_HEADER_BYTES  # the header, then payload into scratch
    assert states == [
        (0, len(big) - first_read),
        (1, 40),  # the rest of the large payload and the next header only
        (2, 0),  # that frame's payload, straight into the sink's views
    ]
    assert [bytes(f) for f in sink.frames] == [big, small]


def _through_a_pump(connection, sink, chunks, pause=0.05):
    client, accepted = connection
    receiver = TcpReceiver(accepted, sink)
    receiver.start()
    assert receiver._pumped
    for chunk in chunks:
        client.sendall(chunk)
        time.sleep(pause)
    return client, receiver


def test_a_pump_delivers_every_frame_whatever_the_pieces(connection, monkeypatch):
    # Random cuts, frames from a few bytes to several scratch buffers and low-water marks.
    sink = _Sink()
    sizes = [36, 3 * _SCRATCH_BYTES + 17, 1, 700_000, 99, 36]
    payloads = _payloads(sizes, seed=1)
    wire = b"".join(_wire(i, p) for i, p in enumerate(payloads))
    rng = np.random.default_rng(2)
    cuts = sorted({int(c) for c in rng.integers(1, len(wire), 40)} | {len(wire)})
    chunks, start = [], 0
    for cut in cuts:
        chunks.append(wire[start:cut])
        start = cut
    client, _ = _through_a_pump(connection, sink, chunks, pause=0.005)
    for _ in payloads:
        assert sink.done.acquire(timeout=10), f"{sink.ended} of {len(payloads)} frames completed"
    assert not sink.failed
    assert [bytes(f) for f in sink.frames] == payloads
    client.close()
    assert sink.done.acquire(timeout=5)
    assert isinstance(sink.failed[0], EOFError)  # a clean close between frames
    assert sink.abandoned.wait(5)


@pytest.mark.parametrize(
    "cut, error, message",
    [
        (FRAME_HEADER_BYTES // 2, ConnectionResetError, "mid-header"),
        (FRAME_HEADER_BYTES + 500, ConnectionResetError, "mid-frame"),
        (FRAME_HEADER_BYTES + 1000, EOFError, "closed the data connection"),
    ],
)
def test_a_connection_closing_mid_frame_is_reported_as_reset_and_between_frames_as_eof(connection, monkeypatch,
                                                                                       cut, error, message):  # fmt: skip
    sink = _Sink()
    wire = _wire(0, _payloads([1000])[0])
    client, receiver = _through_a_pump(connection, sink, [wire[:cut]])
    client.close()
    assert sink.done.acquire(timeout=5)
    if error is EOFError:  # the whole frame came first
        assert sink.ended == 1 and sink.done.acquire(timeout=5)
    assert len(sink.failed) == 1, sink.failed
    assert isinstance(sink.failed[0], error) and message in str(sink.failed[0])
    assert sink.abandoned.wait(5)  # the session learns that nothing more lands (a torn frame is dropped)
    deadline = time.monotonic() + 5
    while receiver.sock.fileno() >= 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.sock.fileno() < 0  # the pump closed the socket once it stopped polling it


def test_an_error_in_the_sink_ends_the_connection_and_reaches_the_session(connection, monkeypatch):
    sink = _Sink(refuse_seq=1)
    payloads = _payloads([40, 40, 40])
    client, receiver = _through_a_pump(connection, sink, [b"".join(_wire(i, p) for i, p in enumerate(payloads))])
    assert sink.done.acquire(timeout=5) and sink.done.acquire(timeout=5)
    assert sink.ended == 1  # frame 0; frame 1 was refused and frame 2 never read
    assert len(sink.failed) == 1 and isinstance(sink.failed[0], ProtocolError)
    assert sink.abandoned.wait(5)
    client.settimeout(5)
    assert client.recv(1) == b""  # the learner's end is closed


def test_closing_a_pumped_receiver_mid_frame_tears_the_frame_quietly(connection, monkeypatch):
    # The session's heartbeat check closes a stalled frame's receiver: the pump stops reading
    # it, the frame is abandoned, and no failure is reported (the session closed it).
    sink = _Sink()
    wire = _wire(0, _payloads([5000])[0])
    client, receiver = _through_a_pump(connection, sink, [wire[:FRAME_HEADER_BYTES + 100]])
    assert receiver.frame_started is not None  # mid-frame
    receiver.close()
    assert sink.abandoned.wait(5)
    assert sink.failed == [] and sink.ended == 0
    client.settimeout(5)
    assert client.recv(1) == b""


def _loopback() -> tuple[socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    actor_side = socket.create_connection(server.getsockname())
    learner_side, _ = server.accept()
    server.close()
    return actor_side, learner_side


def test_a_pump_whose_last_connection_ended_stops_its_thread_and_the_next_gets_a_new_one(monkeypatch):
    # A closed learner leaves no pump thread behind (and no epoll or pipe descriptors).
    monkeypatch.setattr(pump, "_pumps", [])  # a pump of its own, not one another test's sockets hold
    monkeypatch.setattr(TcpReceiver, "pump_spread", 1)  # both connections on one pump
    pairs = [_loopback() for _ in range(2)]
    sinks = [_Sink() for _ in pairs]
    receivers = [TcpReceiver(learner_side, sink) for (_, learner_side), sink in zip(pairs, sinks)]
    for receiver in receivers:
        receiver.start()
    first = receivers[0].pump
    assert first is not None and receivers[1].pump is first and first.thread.is_alive()
    pairs[0][0].close()
    assert sinks[0].abandoned.wait(5)
    time.sleep(0.1)
    assert first.thread.is_alive() and first in pump._pumps  # one connection left
    pairs[1][0].close()
    assert sinks[1].abandoned.wait(5)
    first.thread.join(5)
    assert not first.thread.is_alive() and first not in pump._pumps
    assert first._poll.closed
    again = _loopback()
    sink = _Sink()
    receiver = TcpReceiver(again[1], sink)
    receiver.start()
    assert receiver.pump is not None and receiver.pump is not first and receiver.pump.thread.is_alive()
    again[0].sendall(_wire(0, b"x" * 40))
    assert sink.done.acquire(timeout=5) and sink.ended == 1
    again[0].close()
    receiver.pump.thread.join(5)
    assert not receiver.pump.thread.is_alive()


def test_small_frame_connections_share_a_pump_and_one_streaming_large_frames_gets_its_own(monkeypatch):
    # Pumps that each wake for a frame or two of their own hand the GIL around on every read;
    # a pump does the kernel copy of every byte it reads, though, so a few actors streaming
    # large frames each move to a pump of their own (shm's receivers share from the first).
    monkeypatch.setattr(pump, "_pumps", [])
    pairs = [_loopback() for _ in range(TcpReceiver.own_pump_spread + 3)]
    sinks = [_Sink() for _ in pairs]
    receivers = [TcpReceiver(learner_side, sink) for (_, learner_side), sink in zip(pairs, sinks)]
    for receiver in receivers:
        receiver.start()
    shared = receivers[0].pump
    assert shared is not None and all(r.pump is shared for r in receivers) and len(pump._pumps) == 1
    big = _payloads([3 * _SCRATCH_BYTES + 5, 3 * _SCRATCH_BYTES + 7], seed=5)
    for i, (actor_side, _) in enumerate(pairs):
        if i < 2:  # two connections stream large frames, the rest small ones
            actor_side.sendall(_wire(0, big[i]) + _wire(1, b"s" * 40))
        else:
            actor_side.sendall(_wire(0, b"x" * 40) + _wire(1, b"y" * 40))
    for sink in sinks:
        for _ in range(2):
            assert sink.done.acquire(timeout=10)
    assert [bytes(f) for f in sinks[0].frames] == [big[0], b"s" * 40] and sinks[1].frames[0] == big[1]
    assert all(sink.seqs == [0, 1] and not sink.failed for sink in sinks)
    movers = {id(receivers[0].pump), id(receivers[1].pump)}
    assert shared not in (receivers[0].pump, receivers[1].pump) and len(movers) == 2  # one each
    assert all(r.pump is shared for r in receivers[2:])
    assert sorted(p.connections for p in pump._pumps) == [1, 1, len(pairs) - 2]
    for actor_side, _ in pairs:
        actor_side.close()
    for p in list(pump._pumps):
        p.thread.join(5)
        assert not p.thread.is_alive()

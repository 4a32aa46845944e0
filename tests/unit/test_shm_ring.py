"""The shm plane's ring and counters, over a real memfd and a real loopback TCP connection."""

import os
import socket
import threading
import time

import numpy as np
import pytest

from rlink_ucx.errors import ProtocolError
from rlink_ucx.transport.shm import channel as shm
from rlink_ucx.transport.shm import cma
from rlink_ucx.wire.frame import FRAME_HEADER_BYTES, announced_payload

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not shm.available(), reason="no memfd (not Linux)")]

RING = 64 * 1024


class RecordingSink:
    """A FrameSink whose header's first 8 bytes say the payload size."""

    def __init__(self):
        self.frames: list[bytearray] = []
        self.failure: BaseException | None = None
        self.failed = threading.Event()
        self.ended = threading.Semaphore(0)

    def begin(self, header):
        self.frames.append(bytearray(int.from_bytes(header[:8], "little")))
        return [memoryview(self.frames[-1])]

    def end_threadsafe(self):
        self.ended.release()

    def abandon(self):
        pass

    def fail_threadsafe(self, exc):
        self.failure = exc
        self.failed.set()


def _pair(connection, sink, arena=None, direct=False):
    ring, nonce = shm.ShmRing.create(RING)
    mapped = shm.ShmRing.open(os.getpid(), ring.fd, nonce, RING)
    ring.release_fd()
    learner_view = None
    if arena is not None:  # the learner maps the actor's arena, as at Attach
        pid, fd, arena_nonce, size = arena.describe()
        learner_view = shm.ShmRing.open(pid, fd, arena_nonce, size, shm.ARENA_NAME)
    if direct:  # as at Attach: the learner reads the actor's probe before it accepts addresses
        probe = cma.Probe()
        cma.verify(os.getpid(), probe.describe())
    receiver = shm.ShmReceiver(connection[1], ring, sink, arena=learner_view, actor_pid=os.getpid() if direct else None)
    receiver.start()
    sender = shm.ShmSender(connection[0], mapped, timeout=5, arena=arena)
    sender.direct = direct
    return sender, receiver


def _header(size: int) -> bytes:
    """The payload size where these tests' sinks read it (the first 8 bytes) and where a
    receiver that lands whole frames does (a real header's place for it)."""
    header = bytearray(FRAME_HEADER_BYTES)
    header[:8] = header[48:56] = size.to_bytes(8, "little")
    assert announced_payload(header) == size
    return bytes(header)


def test_frames_arrive_bit_exact_across_many_wraps_of_a_small_ring(connection):
    sink = RecordingSink()
    sender, _ = _pair(connection, sink)
    rng = np.random.default_rng(7)
    sent = []
    for _ in range(200):  # frames up to 3x the ring: the sender waits for room mid-frame
        parts = [rng.integers(0, 256, int(rng.integers(0, 70_000)), dtype=np.uint8) for _ in range(3)]
        sender.send(_header(sum(p.size for p in parts)), [memoryview(p) for p in parts])
        sent.append(b"".join(p.tobytes() for p in parts))
    sender.close()
    assert sink.failed.wait(10)
    assert isinstance(sink.failure, EOFError)  # a clean close between frames
    assert len(sink.frames) == len(sent)
    assert all(bytes(got) == want for got, want in zip(sink.frames, sent))
    assert sender.written > 20 * RING  # it really wrapped


class SlowSink(RecordingSink):
    """A learner that takes a while for each frame, so the actor's ring fills up."""

    def begin(self, header):
        time.sleep(0.001)
        return super().begin(header)


def test_a_frame_up_to_half_the_ring_waits_for_room_before_it_is_announced(connection, monkeypatch):
    """A frame announced before its bytes are in the ring is begun and then resumed as they
    come (a frame's ring space held meanwhile); one that fits in half the ring waits for room
    instead and is never announced before all of it is written (the learner lands it whole)."""
    streamed = []  # frames announced before their bytes were written (then streamed in)
    original = shm.ShmSender._stream
    monkeypatch.setattr(shm.ShmSender, "_stream", lambda self, payload: (streamed.append(1), original(self, payload))[1])
    sink = SlowSink()
    sender, _ = _pair(connection, sink)
    rng = np.random.default_rng(3)
    sent = []
    for _ in range(200):  # 2 frames fill the ring, and the learner is slower than the actor
        parts = [rng.integers(0, 256, int(rng.integers(RING // 8, RING // 4)), dtype=np.uint8) for _ in range(2)]
        sender.send(_header(sum(p.size for p in parts)), [memoryview(p) for p in parts])
        sent.append(b"".join(p.tobytes() for p in parts))
    sender.close()
    assert sink.failed.wait(10) and isinstance(sink.failure, EOFError)
    assert [bytes(f) for f in sink.frames] == sent
    assert sender.written > 50 * RING  # the ring was full again and again
    assert streamed == []


def test_the_ring_is_sealed_against_shrinking_and_checked_by_nonce():
    ring, nonce = shm.ShmRing.create(RING)
    own = os.open(f"/proc/{os.getpid()}/fd/{ring.fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(own, 4096)  # would make the learner's reads fault (SIGBUS)
    finally:
        os.close(own)
    with pytest.raises(OSError, match="nonce"):
        shm.ShmRing.open(os.getpid(), ring.fd, bytes(16), RING)
    with pytest.raises(OSError, match="not the announced"):
        shm.ShmRing.open(os.getpid(), ring.fd, nonce, 2 * RING)
    ring.release_fd()
    with pytest.raises(OSError):
        shm.ShmRing.open(os.getpid(), 999_999, nonce, RING)


@pytest.mark.parametrize("counter", [RING + 1000, 5], ids=["past-the-ring", "backwards"])
def test_a_doorbell_that_overstates_or_rewinds_the_ring_is_a_protocol_error(connection, counter):
    sink = RecordingSink()
    sender, receiver = _pair(connection, sink)
    sender.send(_header(10), [memoryview(b"0123456789")])  # 10 bytes through the ring
    assert sink.ended.acquire(timeout=10)  # delivered before the bad counter comes
    connection[0].sendall(shm.WRITTEN + shm.COUNTER.pack(counter))
    assert sink.failed.wait(10)
    assert isinstance(sink.failure, ProtocolError) and "shared ring" in str(sink.failure)
    assert receiver.sock.fileno() == -1  # the connection was closed
    assert [bytes(f) for f in sink.frames] == [b"0123456789"]  # what came before is kept


def test_a_sender_whose_ring_is_never_freed_times_out(connection):
    actor_side, _ = connection  # nobody reads: no release ever comes
    ring, nonce = shm.ShmRing.create(RING)
    sender = shm.ShmSender(actor_side, shm.ShmRing.open(os.getpid(), ring.fd, nonce, RING), timeout=0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="free room in the shared ring"):
        sender.send(_header(2 * RING), [memoryview(bytes(2 * RING))])
    assert 0.4 < time.monotonic() - started < 5
    sender.close()
    ring.close()


class LandingSink(RecordingSink):
    """A sink that also takes whole frames in one call (as the learner's session does)."""

    def __init__(self):
        super().__init__()
        self.landed = 0

    def land(self, header, payload):
        self.frames.append(bytearray(b"".join(bytes(p) for p in payload)))
        assert len(self.frames[-1]) == int.from_bytes(header[:8], "little")
        self.landed += 1
        self.ended.release()


@pytest.mark.parametrize("sink_kind", [RecordingSink, LandingSink])
def test_frames_in_the_arena_are_read_in_place_and_others_go_through_the_ring(connection, sink_kind):
    sink = sink_kind()
    arena = shm.Arena(4 * RING)
    sender, _ = _pair(connection, sink, arena)
    rng = np.random.default_rng(3)
    block = arena.block(3 * RING)  # a frame buffer with two fields
    sent = []
    for i in range(60):
        a, b = block[: RING], block[RING : 3 * RING]
        a[:] = rng.integers(0, 256, RING, dtype=np.uint8)
        b[:] = rng.integers(0, 256, 2 * RING, dtype=np.uint8)
        n = int(rng.integers(1, RING))
        if i % 3:  # parts of the frame buffer: announced by extents
            parts = [memoryview(a)[:n], memoryview(b)[: 2 * n]]
        else:  # private memory (a large put from the caller's array): through the ring
            parts = [memoryview(rng.integers(0, 256, 2 * n, dtype=np.uint8))]
        sender.send(_header(sum(len(p) for p in parts)), parts)
        sent.append(b"".join(bytes(p) for p in parts))
        assert sink.ended.acquire(timeout=10)  # the learner copied it: the buffer may be refilled
    sender.close()
    assert sink.failed.wait(10) and isinstance(sink.failure, EOFError)
    assert [bytes(f) for f in sink.frames] == sent
    assert sender.arena_frames == 40
    # A sink that lands whole frames gets the arena's that way, as views of its extents (one
    # per field of the frame buffer), and the ring's that do not wrap round its end as a view
    # of the ring; the others stream through begin.
    assert not hasattr(sink, "landed") or 40 < sink.landed < 60, sink.landed
    del a, b, block
    arena.close()


@pytest.mark.parametrize("sink_kind", [RecordingSink, LandingSink])
def test_extents_outside_the_arena_are_a_protocol_error(connection, sink_kind):
    sink = sink_kind()
    arena = shm.Arena(RING)
    _pair(connection, sink, arena)
    record = shm.ARENA_FRAME + _header(100) + shm.COUNTER.pack(1) + shm.EXTENT.pack(RING - 50, 100)
    connection[0].sendall(record)
    assert sink.failed.wait(10)
    assert isinstance(sink.failure, ProtocolError) and "leave the actor's arena" in str(sink.failure)
    arena.close()


def test_an_unsealed_memfd_is_refused(tmp_path):
    fd = os.memfd_create(shm.ARENA_NAME, os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, shm.DATA_OFFSET + RING)  # its owner could shrink it under our mapping
    try:
        with pytest.raises(OSError, match="not sealed"):
            shm.ShmRing.open(os.getpid(), fd, bytes(16), RING, shm.ARENA_NAME)
    finally:
        os.close(fd)


def test_large_payloads_are_read_straight_from_the_actors_memory_small_ones_through_the_ring(connection):
    sink = RecordingSink()
    sender, receiver = _pair(connection, sink, direct=True)
    rng = np.random.default_rng(11)
    sent = []
    small = (100, 7, 3 * RING + 5)
    for size in (100, cma.MIN_BYTES - 3, 7, 2 * cma.MIN_BYTES + 12345, 3 * RING + 5):
        parts = [rng.integers(0, 256, size, dtype=np.uint8), rng.integers(0, 256, 3, dtype=np.uint8)]
        sender.send(_header(size + 3), [memoryview(p) for p in parts])
        # send returned: the learner has read the payload, so the caller may reuse its arrays
        sent.append(b"".join(p.tobytes() for p in parts))
        parts[0][:] = 0
    sender.close()
    assert sink.failed.wait(10) and isinstance(sink.failure, EOFError)
    assert [bytes(f) for f in sink.frames] == sent
    assert sender.direct_frames == 2 and sender.sent_directly == receiver._read_directly == 3 * cma.MIN_BYTES + 12345 + 3
    assert sender.written == sum(small) + 3 * len(small)  # the smaller frames went through the ring


def test_a_frame_by_address_is_refused_unless_the_learner_probed_the_actor(connection):
    sink = RecordingSink()
    sender, receiver = _pair(connection, sink, direct=False)
    sender.direct = True  # the actor claims what the learner never agreed to
    data = np.ones(cma.MIN_BYTES, np.uint8)
    with pytest.raises((ConnectionError, EOFError, TimeoutError)):
        sender.send(_header(data.size), [memoryview(data)])
    assert sink.failed.wait(10)
    assert isinstance(sink.failure, ProtocolError) and "did not probe" in str(sink.failure)


def test_a_frame_at_a_bad_address_is_a_protocol_error_and_earlier_frames_are_kept(connection):
    sink = RecordingSink()
    sender, receiver = _pair(connection, sink, direct=True)
    sender.send(_header(10), [memoryview(b"0123456789")])
    assert sink.ended.acquire(timeout=10)
    size = cma.MIN_BYTES
    record = shm.DIRECT_FRAME + _header(size) + shm.COUNTER.pack(1) + shm.EXTENT.pack(4096, size)  # unmapped
    connection[0].sendall(record)
    assert sink.failed.wait(10)
    assert isinstance(sink.failure, ProtocolError) and "could not be read" in str(sink.failure)
    assert bytes(sink.frames[0]) == b"0123456789"


def test_a_probe_with_the_wrong_nonce_or_address_is_refused():
    probe = cma.Probe()
    address, nonce = probe.describe()
    cma.verify(os.getpid(), [address, nonce])
    with pytest.raises(OSError, match="nonce"):
        cma.verify(os.getpid(), [address, bytes(16)])
    with pytest.raises(OSError):
        cma.verify(os.getpid(), [4096, nonce])
    with pytest.raises(OSError):
        cma.verify(2**22 + 12345, [address, nonce])  # no such process


def test_a_direct_frame_whose_actor_gave_up_waiting_is_dropped_not_delivered(connection):
    # The actor shuts the connection when it stops waiting for a read (and only then lets its
    # caller change the memory): a learner that finishes the read afterwards must drop it.
    sink = RecordingSink()
    ring, nonce = shm.ShmRing.create(RING)
    ring.release_fd()
    probe = cma.Probe()
    cma.verify(os.getpid(), probe.describe())
    data = np.arange(cma.MIN_BYTES, dtype=np.uint8)
    record = shm.DIRECT_FRAME + _header(data.size) + shm.COUNTER.pack(1) + shm.EXTENT.pack(data.ctypes.data, data.size)
    connection[0].sendall(record)
    connection[0].shutdown(socket.SHUT_WR)  # what ShmSender does when its wait for the read fails
    receiver = shm.ShmReceiver(connection[1], ring, sink, actor_pid=os.getpid())
    receiver.start()  # reads the record only now: the memory is still readable, the actor gone
    assert sink.failed.wait(10)
    assert isinstance(sink.failure, ConnectionResetError) and "gave up" in str(sink.failure)
    assert sink.ended.acquire(timeout=0.2) is False  # the frame was never completed


def test_a_sender_that_stops_waiting_for_a_direct_read_shuts_the_connection_first(connection):
    actor_side, learner_side = connection  # a learner that never answers
    ring, nonce = shm.ShmRing.create(RING)
    sender = shm.ShmSender(actor_side, shm.ShmRing.open(os.getpid(), ring.fd, nonce, RING), timeout=0.3)
    sender.direct = True
    data = np.ones(cma.MIN_BYTES, np.uint8)
    with pytest.raises(TimeoutError, match="read the frame"):
        sender.send(_header(data.size), [memoryview(data)])
    learner_side.settimeout(5)
    received = b""
    while chunk := learner_side.recv(65536):  # the record, then EOF: shut before send raised
        received += chunk
    assert received.startswith(shm.DIRECT_FRAME)
    sender.close()
    ring.close()


def _pairs(n: int):
    """``n`` more loopback connections, as the ``connection`` fixture makes them."""
    out = []
    for _ in range(n):
        server = socket.create_server(("127.0.0.1", 0))
        actor_side = socket.create_connection(server.getsockname())
        learner_side, _ = server.accept()
        server.close()
        out.append((actor_side, learner_side))
    return out


def test_four_connections_read_together_and_a_bad_one_fails_alone():
    """Four actors' connections (on the pumps): one sends a counter that
    rewinds the ring and fails with a protocol error; the others go on, every frame bit-exact."""
    connections = _pairs(4)
    sinks = [RecordingSink() for _ in connections]
    senders = [_pair(c, sink)[0] for c, sink in zip(connections, sinks)]
    rng = np.random.default_rng(5)
    sent = [[] for _ in senders]
    for i in range(120):
        for k, sender in enumerate(senders):
            if k == 0 and i == 40:
                connections[0][0].sendall(shm.WRITTEN + shm.COUNTER.pack(1))  # backwards
                continue
            if k == 0 and i > 40:
                continue
            part = rng.integers(0, 256, int(rng.integers(1, RING // 3)), dtype=np.uint8)
            sender.send(_header(part.size), [memoryview(part)])
            sent[k].append(part.tobytes())
    assert sinks[0].failed.wait(10) and isinstance(sinks[0].failure, ProtocolError)
    for sender in senders[1:]:
        sender.close()
    for k in range(1, 4):
        assert sinks[k].failed.wait(10) and isinstance(sinks[k].failure, EOFError)  # clean ends
        assert [bytes(f) for f in sinks[k].frames] == sent[k]
    assert [bytes(f) for f in sinks[0].frames] == sent[0][:40]  # what came before is kept
    for a, b in connections:
        a.close()
        b.close()


def test_a_frame_streaming_through_the_ring_holds_back_no_other_connection():
    """A frame larger than half the ring is announced first and its bytes follow as room comes.
    One whose bytes stop halfway (a slow or hostile actor) holds back only itself: the pump
    that reads it goes on reading other actors' connections, and the frame completes, bit
    exact, once the rest is written."""
    slow_conn, fast_conn = _pairs(2)
    slow_sink, fast_sink = RecordingSink(), RecordingSink()
    slow, _ = _pair(slow_conn, slow_sink)
    fast, _ = _pair(fast_conn, fast_sink)
    size = RING * 3 // 4
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    slow.sock.sendall(shm.RING_FRAME + _header(size))  # what ShmSender.send does before _stream
    slow.ring.copy_in(0, memoryview(data)[: size // 2])
    slow.written = size // 2
    slow._doorbell()  # half of it, then nothing for a while
    rng = np.random.default_rng(2)
    sent = []
    for _ in range(20):
        part = rng.integers(0, 256, int(rng.integers(1, RING // 4)), dtype=np.uint8)
        fast.send(_header(part.size), [memoryview(part)])
        sent.append(part.tobytes())
    assert all(fast_sink.ended.acquire(timeout=5) for _ in sent), "the other connection's frames were held back"
    assert [bytes(f) for f in fast_sink.frames] == sent
    assert not slow_sink.ended.acquire(timeout=0)  # still waiting for its second half
    slow.ring.copy_in(size // 2, memoryview(data)[size // 2 :])
    slow.written = size
    slow._doorbell()
    assert slow_sink.ended.acquire(timeout=5)
    assert bytes(slow_sink.frames[0]) == data.tobytes()
    assert slow_sink.failure is None and fast_sink.failure is None
    for a, b in (slow_conn, fast_conn):
        a.close()
        b.close()


class EndingSink(RecordingSink):
    def __init__(self):
        super().__init__()
        self.abandoned = threading.Event()

    def abandon(self):
        self.abandoned.set()


def test_a_receiver_closed_by_the_learner_ends_quietly_and_its_socket_is_closed(connection):
    """``close`` from another thread (the session ending): no failure is reported, the sink is
    told nothing more will land, and the socket is closed (by the pump, once it stopped
    polling it)."""
    sink = EndingSink()
    sender, receiver = _pair(connection, sink)
    sender.send(_header(10), [memoryview(b"0123456789")])
    assert sink.ended.acquire(timeout=10)
    receiver.close()
    assert sink.abandoned.wait(10)
    assert sink.failure is None
    assert wait_closed(receiver.sock)
    sender.close()


def wait_closed(sock, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while sock.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return sock.fileno() == -1


class RefusingLandingSink(LandingSink):
    def land(self, header, payload):
        raise ProtocolError("refused by the session")


def test_a_landed_frame_the_session_refuses_fails_the_connection_and_the_ring_still_closes(connection):
    # The refusal's traceback holds the frame's views of the shared ring: released, or the
    # receiver could not unmap the ring when it ends (BufferError on its thread).
    sink = RefusingLandingSink()
    sender, receiver = _pair(connection, sink)
    sender.send(_header(10), [memoryview(b"0123456789")])  # small: copied into the ring, then announced
    assert sink.failed.wait(10)
    assert isinstance(sink.failure, ProtocolError) and "refused by the session" in str(sink.failure)
    deadline = time.monotonic() + 10
    while not receiver.ring.mm.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.ring.mm.closed
    sender.close()

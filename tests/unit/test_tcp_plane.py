"""The tcp data plane's socket handling, over real loopback sockets (one process, no learner):
frames whose tail is below the receiver's low-water mark, the sender's kernel timeout, and
the congestion control of a data connection (``Config.tcp_congestion``)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from rlink_ucx.transport.sockopts import LOOPBACK_CONGESTION, congestion_of
from rlink_ucx.transport.tcp.stream import RECV_LOW_WATER, TcpReceiver, TcpSender
from rlink_ucx.wire.frame import FrameHeader

pytestmark = pytest.mark.timeout(60)


class _Sink:
    """Keeps each frame's payload; records completions and failures."""

    def __init__(self) -> None:
        self.frames: list[bytearray] = []
        self.done = threading.Semaphore(0)
        self.failed: list[BaseException] = []

    def begin(self, header: bytes) -> list[memoryview]:
        self.frames.append(bytearray(FrameHeader.unpack(header).payload_bytes))
        return [memoryview(self.frames[-1])]

    def end_threadsafe(self) -> None:
        self.done.release()

    def abandon(self) -> None:
        pass

    def fail_threadsafe(self, exc: BaseException) -> None:
        self.failed.append(exc)
        self.done.release()


def _header(seq: int, nbytes: int) -> bytes:
    return FrameHeader(1, 1, 7, 0, seq, 0, nbytes).pack()


def test_a_frame_tail_below_the_low_water_mark_arrives_with_nothing_after_it(connection):
    # The receiver sleeps until RECV_LOW_WATER bytes are in while a frame streams in. Linux wakes a reader only at the low-water mark, even one that asks for less, so a mark above
    # the frame's remaining bytes would hold the tail back until the actor sent more.
    client, accepted = connection
    sink = _Sink()
    receiver = TcpReceiver(accepted, sink)
    receiver.start()
    assert receiver._pumped
    rng = np.random.default_rng(0)
    sizes = [RECV_LOW_WATER + 12_345, 100, 3 * RECV_LOW_WATER + 1]
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    for seq, payload in enumerate(payloads):
        wire = _header(seq, len(payload)) + payload
        # In three pieces with pauses, so the receiver blocks mid-header, mid-payload and
        # short of its tail; nothing follows the last piece until the frame is in.
        cuts = [17, 40 + RECV_LOW_WATER // 2, len(wire)]
        start = 0
        for cut in cuts:
            client.sendall(wire[start:cut])
            start = cut
            time.sleep(0.2)
        assert sink.done.acquire(timeout=5), f"frame {seq} of {len(payload)} bytes never completed"
        assert not sink.failed
        assert bytes(sink.frames[seq]) == payload
    client.close()
    assert sink.done.acquire(timeout=5)
    assert isinstance(sink.failed[0], EOFError)  # a clean close between frames


def test_a_send_nobody_reads_times_out_in_bounded_time(connection):
    client, _accepted = connection  # the peer never reads
    sender = TcpSender(client, loop=None, timeout=0.5)  # type: ignore[arg-type]
    payload = memoryview(np.zeros(256 << 20, np.uint8))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="took no data for 0.5s"):
        sender.send(_header(0, len(payload)), [payload])
    assert time.monotonic() - started < 10



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CONGESTION is Linux-only")
def test_both_ends_of_a_loopback_data_connection_stop_pacing(paced_connection):
    # The system default may be BBR, which paces; on loopback that only costs timers.
    client, accepted = paced_connection
    TcpSender(client, loop=None, timeout=5)  # type: ignore[arg-type]
    TcpReceiver(accepted, _Sink())
    assert [congestion_of(s) for s in (client, accepted)] == [LOOPBACK_CONGESTION] * 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CONGESTION is Linux-only")
def test_config_system_keeps_the_default_on_a_data_connection(paced_connection):
    client, accepted = paced_connection
    before = [congestion_of(s) for s in (client, accepted)]
    TcpSender(client, loop=None, timeout=5, congestion="system")  # type: ignore[arg-type]
    TcpReceiver(accepted, _Sink(), congestion="system")
    assert [congestion_of(s) for s in (client, accepted)] == before

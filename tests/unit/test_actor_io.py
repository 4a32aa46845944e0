"""The actor's I/O loop work: the heartbeat, one timer armed for the next moment something is
due, never a periodic tick (driven here on a real event loop with a stand-in control
connection), and the frame headers the outbox packs."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlink_ucx import Config
from rlink_ucx.errors import PeerLost
from rlink_ucx.session.actor.heartbeat import Heartbeat
from rlink_ucx.wire import messages as _wire

pytestmark = pytest.mark.timeout(30)


class _Control:
    def __init__(self) -> None:
        self.last_send = time.monotonic()
        self.sent: list[float] = []

    def send(self, msg: object) -> None:
        assert isinstance(msg, _wire.Heartbeat)
        self.last_send = time.monotonic()
        self.sent.append(self.last_send)


class _State:
    """Just what the heartbeat reads: the control connection (the shared state's) and the last
    frame (the outbox's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float, timeout: float):
        self.loop = loop
        self.config = Config(heartbeat_interval=interval, heartbeat_timeout=timeout)
        self.control = _Control()
        self.frame_sent_at = 0.0


class _Reader(Heartbeat):
    """The heartbeat, with ``fail`` recording instead of reconnecting."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float, timeout: float):
        self.state = _State(loop, interval, timeout)
        self.failed: list[tuple[float, Exception]] = []
        self.arms = 0
        super().__init__(self.state, self.state, self.failed_with)  # type: ignore[arg-type]  # state and outbox

    def failed_with(self, exc: Exception) -> None:
        self.failed.append((time.monotonic(), exc))

    def _heartbeat_due(self) -> float:
        self.arms += 1
        return super()._heartbeat_due()


def _run(reader: _Reader, seconds: float, *others) -> None:
    async def main() -> None:
        task = reader.state.loop.create_task(reader.run())
        helpers = [reader.state.loop.create_task(o) for o in others]
        await asyncio.sleep(seconds)
        for t in (task, *helpers):
            t.cancel()
        await asyncio.gather(task, *helpers, return_exceptions=True)

    reader.state.loop.run_until_complete(main())


def test_a_silent_learner_is_given_up_after_the_timeout_even_while_frames_keep_leaving():
    # Frames leaving all the time keep our side of the liveness fresh, so the only timer left
    # is the learner's timeout. It once re-armed itself for "now" over and over (spinning the
    # loop at 100%) and never gave up: each tiny lateness was credited to the learner.
    loop = asyncio.new_event_loop()
    try:
        reader = _Reader(loop, interval=0.05, timeout=0.3)
        started = time.monotonic()

        async def frames() -> None:
            while True:
                reader.state.frame_sent_at = time.monotonic()
                await asyncio.sleep(0.002)

        _run(reader, 0.6, frames())
    finally:
        loop.close()
    assert len(reader.failed) == 1 and isinstance(reader.failed[0][1], PeerLost), reader.failed
    assert 0.29 <= reader.failed[0][0] - started <= 0.45
    assert reader.state.control.sent == []  # the frames said we are alive
    assert reader.arms <= 20, reader.arms  # woke only when something was due


def test_our_own_heartbeat_follows_a_silence_and_the_learners_is_answered_at_once():
    loop = asyncio.new_event_loop()
    try:
        reader = _Reader(loop, interval=0.1, timeout=5.0)

        learner: list[float] = []

        async def learner_heartbeats() -> None:  # the learner, every interval of its silence
            await asyncio.sleep(0.5)
            for _ in range(5):
                reader.heard()
                learner.append(reader.last_heard)
                reader.answer()
                await asyncio.sleep(0.1)

        t0 = time.monotonic()
        _run(reader, 1.0, learner_heartbeats())
    finally:
        loop.close()
    own = [t - t0 for t in reader.state.control.sent if t < learner[0]]
    later = [t for t in reader.state.control.sent if t >= learner[0]]
    # Alone, we speak after 1.5 intervals of silence (about 3 times in 0.5 s)...
    assert 2 <= len(own) <= 4, own
    # ...and while the learner's heartbeats come, we answer them (all but one that came right
    # after our own) as they come, and add none of our own.
    assert len(later) >= 4, later
    assert all(any(0 <= t - h < 0.005 for h in learner) for t in later), (later, learner)
    assert reader.failed == []


def test_the_outbox_packs_frame_headers_exactly_as_the_wire_module_does():
    # The outbox packs headers itself (no dataclass per frame): any change to the header's
    # layout in wire.frame must be made there too, or this fails.
    from rlink_ucx.session.actor.outbox import pack_header
    from rlink_ucx.wire.frame import FrameHeader

    values = (7, 12_345, 3, 2**63 - 5, 2**40 + 17, 9, 12_345 * 29, 1_700_000_000_123_456)
    packed = pack_header(*values)
    assert packed == FrameHeader(*values[:7], 0, values[7]).pack()
    assert FrameHeader.unpack(packed) == FrameHeader(*values[:7], 0, values[7])

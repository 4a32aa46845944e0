"""An actor wakes only when it has something to do: a step put while its I/O side is idle goes
out on the caller's thread (no hand-off to the I/O thread, no linger timer), and an idle actor's
I/O thread wakes once per learner heartbeat (answering it), not on a periodic tick. On ucx,
where only the I/O thread may send, such a step is handed to it at once instead of lingering.

Wake-ups are counted, not timed: the actor's I/O loop is made to count the times its selector
blocks (each is one sleep, and so one wake-up), in this process; the learner runs in its own.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any, Self

import numpy as np
import pytest

from rlink_ucx import Actor, Config
from tests.conftest import shm_possible, ucx_importable

SPAWN = mp.get_context("spawn")
TRANSPORTS = ["tcp", pytest.param("shm", marks=pytest.mark.skipif(not shm_possible(), reason="no memfd"))]


def _learner(config: Config, ready: Any, stop: Any, out: Any) -> None:
    """A learner whose consumer fetches every step; reports the steps' rewards and whether the
    actor was ever lost."""
    from rlink_ucx import Learner, RLinkDataset
    from rlink_ucx import TimeoutError as FetchTimeout

    with Learner("127.0.0.1:0", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        got: list[float] = []

        def consume() -> None:
            # ``stop`` comes once the actor has flushed and closed: every step is in the ring
            # then, so a fetch that finds nothing after it means all were taken.
            while True:
                try:
                    got.extend(dataset.fetch(timeout=0.2)["reward"].tolist())
                except FetchTimeout:
                    if stop.is_set():
                        return

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        ready.put(learner.address)
        stop.wait(60)
        consumer.join(30)
        out.put({"rewards": got, "lost_actors": learner.stats()["lost_actors"]})


class _Learner:
    def __init__(self, config: Config):
        self.ready, self.out, self.stop = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
        self.proc = SPAWN.Process(target=_learner, args=(config, self.ready, self.stop, self.out), daemon=True)

    def __enter__(self) -> Self:
        self.proc.start()
        self.address = self.ready.get(timeout=60)
        return self

    def result(self) -> dict[str, Any]:
        self.stop.set()
        return self.out.get(timeout=30)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def count_sleeps(actor: Actor) -> list[int]:
    """Make the actor's I/O loop count the times it blocks in its selector (with a timeout
    other than zero: a wait, so one wake-up each); returns the live counter."""
    selector = actor._io.loop._selector  # the loop thread reads the attribute at every pass
    real = selector.select
    sleeps = [0]

    def select(timeout: float | None = None) -> Any:
        if timeout is None or timeout > 0:
            sleeps[0] += 1
        return real(timeout)

    selector.select = select
    return sleeps


def step(i: int) -> dict[str, Any]:
    return {"obs": np.zeros(4, np.float32), "action": i, "reward": float(i), "done": False}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_step_put_while_the_io_side_is_idle_is_on_the_wire_when_put_returns(transport):
    # Heartbeats far apart: nothing else may wake the actor during the puts.
    config = Config(heartbeat_interval=5.0, heartbeat_timeout=30.0)
    with _Learner(config) as learner:
        with Actor(learner.address, transport=transport, config=config) as actor:
            actor.put(step(0))
            actor.flush(30)
            time.sleep(2 * config.frame_linger)
            sleeps = count_sleeps(actor)
            time.sleep(0.05)  # the loop passes its select once with the counter in place
            before, frames = sleeps[0], actor.stats()["frames_sent"]
            sent_at_return = []
            for i in range(1, 11):
                time.sleep(0.03)  # a slow actor: more than frame_linger between steps
                actor.put(step(i))
                sent_at_return.append(actor.stats()["frames_sent"] - frames)
            wakeups = sleeps[0] - before
            armed = actor._writer._armed
            actor.flush(30)
        result = learner.result()
    # Each step was a frame of its own, written by put itself before it returned...
    assert sent_at_return == list(range(1, 11))
    # ...without waking the I/O thread (the old path woke it three times or more per step:
    # the hand-off, the linger timer, its hand-off to the send loop) or arming a timer.
    assert wakeups <= 2, wakeups
    assert not armed
    assert result["rewards"] == [float(i) for i in range(11)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_steps_put_faster_than_the_linger_fill_frames(transport):
    # Under load a frame is not sent per step: a step that comes within frame_linger of the
    # last frame waits for company (and the linger timer sends it at the latest).
    config = Config(frame_linger=0.05)
    with _Learner(config) as learner:
        with Actor(learner.address, transport=transport, config=config) as actor:
            actor.put(step(0))
            actor.flush(30)
            time.sleep(2 * config.frame_linger)
            frames = actor.stats()["frames_sent"]
            actor.put(step(1))
            first = actor.stats()["frames_sent"] - frames
            for i in range(2, 101):
                actor.put(step(i))
            put_done = time.monotonic()
            while actor.stats()["steps_sent"] < 101 and time.monotonic() - put_done < 5:
                time.sleep(0.005)
            waited = time.monotonic() - put_done
            sent = actor.stats()["frames_sent"] - frames
        result = learner.result()
    assert first == 1  # the first step at once (the I/O side was idle)...
    assert 2 <= sent <= 4, sent  # ...the 99 others together (a tick may split them, if this machine stalls us)
    assert waited < 1.0, waited  # the linger timer sent them, not the close
    assert result["rewards"] == [float(i) for i in range(101)]


@pytest.mark.timeout(90)
@pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")
def test_a_ucx_step_put_while_the_io_side_is_idle_leaves_at_once_not_after_the_linger():
    # A long linger: a step that waited for the linger timer (at least half a linger, the
    # timer's phase) would arrive a second late; handed to the I/O thread it leaves at once.
    config = Config(frame_linger=2.0, heartbeat_interval=5.0, heartbeat_timeout=30.0)
    with _Learner(config) as learner:
        with Actor(learner.address, transport="ucx", config=config) as actor:
            assert actor.stats()["transport"] == "ucx"
            actor.put(step(0))
            actor.flush(30)
            # The first step may have come before the learner's first credit (a loaded
            # machine): it waited for the linger timer, which stops after two idle ticks. The
            # steps below must find the I/O side idle, with no timer left from it.
            deadline = time.monotonic() + 3 * config.frame_linger + 10
            while actor._writer._armed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not actor._writer._armed
            delays, armed = [], []
            for i in range(1, 4):
                time.sleep(config.frame_linger + 0.1)  # the last frame left over a linger ago
                frames, put_at = actor.stats()["frames_sent"], time.monotonic()
                actor.put(step(i))
                while actor.stats()["frames_sent"] == frames and time.monotonic() - put_at < 5:
                    time.sleep(0.002)
                delays.append(time.monotonic() - put_at)
                armed.append(actor._writer._armed)
            actor.flush(30)
        result = learner.result()
    assert max(delays) < 0.5, delays  # the linger timer would have taken 1 s or more
    assert armed == [False] * 3  # and no timer was armed for them
    assert result["rewards"] == [float(i) for i in range(4)]


@pytest.mark.timeout(90)
def test_an_idle_actor_wakes_once_per_learner_heartbeat_and_stays_connected():
    interval, window = 0.2, 3.0
    config = Config(heartbeat_interval=interval, heartbeat_timeout=2.0)
    with _Learner(config) as learner:
        with Actor(learner.address, transport="tcp", config=config) as actor:
            actor.put(step(0))
            actor.flush(30)
            sleeps = count_sleeps(actor)
            time.sleep(0.5)
            before = sleeps[0]
            time.sleep(window)
            wakeups = sleeps[0] - before
            stats = actor.stats()
        result = learner.result()
    heartbeats = window / interval  # the learner's, one per interval of its silence
    # One wake-up per learner heartbeat (it is answered at once); a periodic heartbeat tick of
    # our own would add one per interval more.
    assert wakeups <= 1.4 * heartbeats, (wakeups, heartbeats)
    # Yet both sides kept each other alive, with timeouts of 10 intervals.
    assert stats["connected"] and stats["reconnects"] == 0, stats
    assert result["lost_actors"] == 0 and result["rewards"] == [0.0]

"""The demo's stop signal survives an actor killed while it was asking it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from rlink_ucx.demo.actor import StopFlag
from tests.integration.demo_procs import spin_until_stopped

SPAWN = mp.get_context("spawn")


@pytest.mark.timeout(60)
def test_an_actor_killed_while_asking_to_stop_blocks_neither_the_others_nor_the_learner():
    # With a multiprocessing.Event, the SIGKILLed process mostly held the Event's lock (is_set
    # takes it): the learner's set() and every other actor's is_set() then blocked for good, and
    # `rlink demo --kill-one-actor-after` hung now and then.
    stop = StopFlag(SPAWN)
    victim, survivor = (SPAWN.Process(target=spin_until_stopped, args=(stop,)) for _ in range(2))
    victim.start()
    survivor.start()
    time.sleep(1.0)  # both asking
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    setter = threading.Thread(target=stop.set, daemon=True)
    setter.start()
    setter.join(5)
    assert not setter.is_alive(), "set() blocked"
    survivor.join(10)
    assert survivor.exitcode == 0, "the other actor never saw the stop"

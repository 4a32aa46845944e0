"""The replay's insert/sample gate on its own, with real threads: who waits for whom."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from rlink_ucx.store.replay.core import ReplaySettings
from rlink_ucx.store.replay.gate import InsertGate
from rlink_ucx.store.replay.staging import StagingPool
from tests.unit.replay_helpers import wait_for


def _insert(gate: InsertGate, evicts: bool, done: threading.Event) -> None:
    with gate.cond:
        gate.wait_to_insert(evicts)
        gate.begin_insert()
    done.set()


@pytest.mark.timeout(30)
def test_an_evicting_insert_waits_for_gathers_and_holds_new_samples_back():
    gate = InsertGate()
    with gate.cond:
        gate.begin_gather()
    done = threading.Event()
    t = threading.Thread(target=_insert, args=(gate, True, done))
    t.start()
    assert wait_for(lambda: gate.evicting == 1)
    with gate.cond:
        assert not gate.may_sample() and not done.is_set()
        gate.end_gather()  # the last gather wakes it
    assert done.wait(10)
    t.join(10)
    assert gate.inserting and gate.evicting == 0 and gate.may_sample()


@pytest.mark.timeout(30)
def test_an_insert_that_does_not_evict_runs_beside_a_gather():
    gate = InsertGate()
    with gate.cond:
        gate.begin_gather()
        gate.wait_to_insert(False)  # returns at once
        gate.begin_insert()
        assert gate.inserting and gate.gathering == 1 and gate.evicting == 0


@pytest.mark.timeout(30)
def test_a_pause_waits_for_the_insert_in_flight_and_holds_the_next():
    gate = InsertGate()
    with gate.cond:
        gate.begin_insert()
    paused = threading.Event()
    t = threading.Thread(target=lambda: (gate.pause(), paused.set()))
    t.start()
    assert wait_for(lambda: gate.paused == 1)
    assert not paused.is_set()  # the insert in flight comes first
    with gate.cond:
        gate.end_insert()
        gate.cond.notify_all()
    assert paused.wait(10)
    t.join(10)
    done = threading.Event()
    t = threading.Thread(target=_insert, args=(gate, False, done))
    t.start()
    assert not done.wait(0.2)  # no insert while paused
    gate.resume()
    assert done.wait(10)
    t.join(10)
    assert gate.paused == 0 and gate.inserting


def test_settings_are_fixed_and_the_pool_only_grows():
    s = ReplaySettings(capacity=10, batch_size=2, sampler="uniform", sequence_length=None, alpha=0.6, beta=0.4,
                       storage="host", device=None, cuda=False, pin=False)  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.capacity = 20  # type: ignore[misc]
    pool = StagingPool()
    pool.reserve(8)
    pool.reserve(2)
    assert pool.size == 8

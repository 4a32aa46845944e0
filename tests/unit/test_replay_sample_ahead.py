"""Batches drawn ahead of ``sample()`` by two threads (``store/sample_ahead.py``), and gathers
that copy outside the replay's lock while inserts evict (``ReplayCore``).

Steps encode who sent them (``replay_helpers.steps``: obs = [actor, seq, seq / 2], action =
actor * 1e6 + seq), so a row torn by an eviction during its copy, or a staging buffer handed
to two batches, shows as a row whose bytes disagree with the batch's own metadata.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rlink_ucx import Closed, ConfigError, ReplayDataset
from rlink_ucx import TimeoutError as RLinkTimeout
from rlink_ucx.store.replay import core as replay_core
from rlink_ucx.store.replay.block_table import BlockTable
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import Schema
from tests.unit.replay_helpers import SCHEMA, FakeLearner, feed, new_ring, put, steps, stream, wait_for

pytestmark = pytest.mark.timeout(120)

# Steps large enough that a batch's copy takes a while (the window an eviction could hit).
WIDE = Schema.from_spec({"obs": ("float32", (3,)), "action": ("int64", ()), "done": ("bool", ()),
                         "pad": ("uint8", (4096,))})  # fmt: skip


def check_rows(batch) -> None:
    """Every row's bytes are those of the step its metadata names."""
    actor = batch.actor_id.numpy()
    seq = batch.seq.numpy()
    obs = batch["obs"].numpy()
    assert np.array_equal(obs[:, 0], actor.astype(np.float32))
    assert np.array_equal(obs[:, 1], seq.astype(np.float32))
    assert np.array_equal(batch["action"].numpy(), actor * 1_000_000 + seq)
    assert np.array_equal(batch.index.numpy() >= 0, np.ones(len(seq), bool))


def ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rlink-replay-ahead")]


def test_default_draws_ahead_only_where_nothing_but_timing_changes():
    ring = new_ring()
    cases = [({}, 2), ({"seed": 1}, 0), ({"sampler": "prioritized"}, 0), ({"sampler": "fifo"}, 0),
             ({"samples_per_insert": 2.0}, 0), ({"storage": "device"}, 0), ({"prefetch": 0}, 0),
             ({"prefetch": 3}, 3)]  # fmt: skip
    for kw, want in cases:
        with ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, **kw) as r:
            assert r.prefetch == want, kw
    with pytest.raises(ConfigError, match="prioritized"):
        ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, sampler="prioritized", prefetch=2)
    with pytest.raises(ConfigError, match="seed"):
        ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, seed=0, prefetch=2)
    with pytest.raises(ConfigError, match=">= 0"):
        ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, prefetch=-1)


@pytest.mark.parametrize("blocks", [False, True], ids=["copying-table", "block-table"])
def test_rows_stay_whole_while_inserts_evict_them(monkeypatch, blocks):
    """Two threads gather ahead while an actor streams through a table 3x smaller than what it
    sends: every row of every batch matches its metadata, and no batch is lost or repeated."""
    if blocks:
        monkeypatch.setattr(replay_core, "ADOPT_MIN_BYTES", 0)
        ring = StepRing(WIDE, 256 * WIDE.step_bytes, 16, chunk_steps=32)
    else:
        ring = StepRing(WIDE, 4096 * WIDE.step_bytes, 64)
    total, capacity = 40_000, 2048 if blocks else 4000
    with ReplayDataset(FakeLearner(ring), capacity=capacity, batch_size=256, prefetch=2) as r:
        stop = threading.Event()
        feeder = threading.Thread(target=_stream_wide, args=(ring, total, 16 if blocks else 64, stop))
        feeder.start()
        try:
            assert wait_for(lambda: r._core.table is not None)
            assert isinstance(r._core.table, BlockTable) == blocks
            kept, batches, evicted_seen = [], 0, 0
            while feeder.is_alive() or batches < 100:
                batch = r.sample(timeout=10)
                check_rows(batch)
                batches += 1
                evicted_seen = max(evicted_seen, r.inserted - len(r))
                if batches % 7 == 0:
                    kept.append(batch)  # held by the caller: its staging must not be reused meanwhile
        finally:
            stop.set()
            feeder.join()
        for batch in kept:
            check_rows(batch)
        assert wait_for(lambda: r.inserted == total) and len(r) == capacity
        assert evicted_seen > 0


def _stream_wide(ring: StepRing, n: int, frame: int, stop: threading.Event) -> None:
    """One actor's steps with a ``pad`` field, each frame once the ring has room for it."""
    for lo in range(0, n, frame):
        k = min(frame, n - lo)
        while ring.grantable() < k:
            if stop.is_set():
                return
            time.sleep(0.0002)
        values = steps(1, lo, k)
        values["pad"] = np.full((k, 4096), lo % 251, np.uint8)
        feed(ring, 1, lo, values)


def test_drawn_uniformly_and_every_batch_distinct():
    """6,400 draws over 100 held steps: each id within 5 sigma of its 64 expected draws, and
    no batch handed out twice (a staging set shared by two batches would repeat one)."""
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=100, batch_size=32, prefetch=2) as r:
        put(ring, 1, 0, 100)
        assert wait_for(lambda: r.inserted == 100)
        counts = np.zeros(100, dtype=np.int64)
        seen = set()
        for _ in range(200):
            batch = r.sample(timeout=10)
            check_rows(batch)
            ids = batch.index.numpy()
            seen.add(ids.tobytes())
            np.add.at(counts, ids, 1)
        assert counts.sum() == 6400 and len(seen) == 200
        assert counts.min() >= 64 - 40 and counts.max() <= 64 + 40, counts


def test_staleness_is_that_of_the_version_when_returned():
    ring = new_ring()
    learner = FakeLearner(ring)
    with ReplayDataset(learner, capacity=100, batch_size=10, prefetch=2) as r:
        put(ring, 1, 0, 50, version=3)
        assert wait_for(lambda: r.inserted == 50)
        assert r.sample(timeout=10).staleness.tolist() == [-3] * 10  # learner at 0, steps at 3
        assert wait_for(lambda: len(r._ahead.ready) == 2)  # the next two were drawn at version 0
        learner.version = 8
        batch = r.sample(timeout=10)
        assert batch.version.tolist() == [3] * 10 and batch.staleness.tolist() == [5] * 10


def test_too_few_steps_times_out_saying_why():
    with ReplayDataset(FakeLearner(new_ring()), capacity=100, batch_size=10, min_size=20, prefetch=2) as r:
        started = time.monotonic()
        with pytest.raises(RLinkTimeout, match=r"after 0.3s: 0 steps held, min_size is 20"):
            r.sample(timeout=0.3)
        assert 0.25 < time.monotonic() - started < 2.0


def test_close_stops_the_threads_and_later_samples_raise_closed():
    ring = new_ring()
    r = ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, prefetch=2)
    stream(ring, 1, 0, 40)
    assert wait_for(lambda: r.inserted == 40)
    r.sample(timeout=10)
    assert wait_for(lambda: len(ahead_threads()) == 2)
    r.close()
    with pytest.raises(Closed):
        r.sample(timeout=1)
    assert wait_for(lambda: not ahead_threads(), timeout=5)


def test_a_dropped_replay_stops_its_threads():
    ring = new_ring()
    r = ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, prefetch=2)
    put(ring, 1, 0, 40)
    assert wait_for(lambda replay=r: replay.inserted == 40)
    r.sample(timeout=10)
    assert wait_for(lambda: len(ahead_threads()) == 2)
    del r
    assert wait_for(lambda: not ahead_threads(), timeout=5)


def test_an_insert_that_evicts_waits_for_a_gather_in_flight():
    """The lock rule itself: while a gather copies outside the lock, an insert that must evict
    waits for it, and no new sample starts meanwhile."""
    ring = new_ring(SCHEMA)
    with ReplayDataset(FakeLearner(ring), capacity=64, batch_size=8, prefetch=0) as r:
        put(ring, 1, 0, 64)
        assert wait_for(lambda: r.inserted == 64)
        core = r._core
        with core.cond:
            core.gate.gathering += 1  # as a sample between finding its rows and copying them
        put(ring, 1, 64, 8)  # must evict 8
        time.sleep(0.3)
        assert r.inserted == 64 and core.gate.evicting == 1  # the insert waits, before evicting
        with pytest.raises(RLinkTimeout):
            r.sample(timeout=0.2)  # and samples wait for it
        with core.cond:
            core.gate.gathering -= 1
            core.cond.notify_all()
        assert wait_for(lambda: r.inserted == 72)
        check_rows(r.sample(timeout=5))


def test_a_staging_set_is_not_handed_out_twice_before_its_batch_exists():
    """Between finding its rows (under the lock) and wrapping the staging in tensors (outside
    it), a sample's staging set is claimed: another sample gets another set."""
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, prefetch=0) as r:
        put(ring, 1, 0, 20)
        assert wait_for(lambda: r.inserted == 20)
        core = r._core
        with core.cond:
            first = core._staging(10)
            second = core._staging(10)
        assert first is not second
        first.claimed = second.claimed = False
        with core.cond:
            assert core._staging(10) is first  # free again: reused, not a new set


def test_a_save_that_begins_while_an_insert_waits_for_a_gather_is_not_written_under():
    """An insert waiting for a gather before it evicts must look again for a save that began
    meanwhile: the save's snapshot comes first (found in review: it used to go on and write
    rows the save was streaming)."""
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=100, batch_size=10, prefetch=0) as r:
        core = r._core
        put(ring, 1, 0, 100)
        assert wait_for(lambda: r.inserted == 100)
        with core.cond:
            core.gate.gathering += 1  # a gather copying outside the lock
        put(ring, 1, 100, 10)  # must evict: waits for the gather
        assert wait_for(lambda: core.gate.evicting == 1)
        core.pause()  # a checkpoint save begins
        with core.cond:
            core.gate.gathering -= 1
            core.cond.notify_all()
        time.sleep(0.3)
        assert r.inserted == 100 and len(r) == 100  # nothing moved under the save
        core.resume()
        assert wait_for(lambda: r.inserted == 110)
        check_rows(r.sample(timeout=5))

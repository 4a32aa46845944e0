"""The batch gather split between the caller and a helper thread (``store/split_gather.py``):
the rows it returns are exactly those of one ``np.take`` per field, whoever copies which chunk."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from rlink_ucx import ReplayDataset
from rlink_ucx.store.replay import split_gather
from rlink_ucx.store.replay.split_gather import gather_rows
from rlink_ucx.store.replay.table import ReplayTable
from rlink_ucx.wire.codec import Schema
from tests.unit.replay_helpers import FakeLearner, feed, new_ring, wait_for

BIG = Schema.from_spec({"obs": ("uint8", (84, 84, 4)), "action": ("int64", ()), "done": ("bool", ())})


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setattr(split_gather, "enabled", True)  # also on a one-core machine
    monkeypatch.setattr(split_gather, "SPLIT_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(split_gather, "chooser", Always())  # every gather split


class Always(split_gather.Chooser):
    def pick(self) -> bool:
        return True


def tables(rows: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (rows, spec.step_bytes), dtype=np.uint8) for spec in BIG.fields]


def test_split_gather_matches_one_take_per_field(split):
    storage = tables(1000, 0)
    rng = np.random.default_rng(1)
    for n in (2, 3, 37, 256, 511):  # odd sizes: chunks that do not divide the batch
        rows = rng.integers(0, 1000, n)
        outs = [np.full((n, s.shape[1]), 7, dtype=np.uint8) for s in storage]
        gather_rows(list(zip(storage, outs)), rows)
        for s, out in zip(storage, outs):
            assert np.array_equal(out, np.take(s, rows, axis=0)), n


def test_the_helper_copies_chunks(split, monkeypatch):
    """The helper thread really takes part (else the split is dead code), and the caller still
    gets the exact rows: the caller is slowed down so that the helper claims chunks."""
    helpers: set[str] = set()
    real = split_gather._take

    def take(storage, rows, out):
        helpers.add(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            threading.Event().wait(0.002)  # let the helper claim the next chunk
        real(storage, rows, out)

    monkeypatch.setattr(split_gather, "_take", take)
    storage = tables(600, 2)
    rows = np.random.default_rng(3).integers(0, 600, 256)
    for _ in range(5):
        outs = [np.zeros((256, s.shape[1]), dtype=np.uint8) for s in storage]
        gather_rows(list(zip(storage, outs)), rows)
        for s, out in zip(storage, outs):
            assert np.array_equal(out, s[rows])
    assert "rlink-replay-gather" in helpers


def test_without_the_helper_running_the_caller_copies_everything(split, monkeypatch):
    """A helper that never gets to run (both cores busy elsewhere) must not hold the caller."""
    blocked = threading.Event()
    monkeypatch.setattr(split_gather, "_jobs", None)
    monkeypatch.setattr(split_gather, "_serve", lambda jobs: blocked.wait(30))  # takes no job
    storage = tables(300, 4)
    rows = np.arange(299, -1, -3)
    outs = [np.zeros((rows.size, s.shape[1]), dtype=np.uint8) for s in storage]
    gather_rows(list(zip(storage, outs)), rows)
    blocked.set()
    for s, out in zip(storage, outs):
        assert np.array_equal(out, s[rows])


def test_a_chunk_the_helper_failed_fails_the_gather(split, monkeypatch):
    """Never a batch with a chunk missing: the helper's error reaches the caller."""
    real = split_gather._take

    def take(storage, rows, out):
        if threading.current_thread().name == "rlink-replay-gather":
            raise MemoryError("as if the helper could not copy")
        threading.Event().wait(0.002)  # the caller is slow: the helper claims a chunk
        real(storage, rows, out)

    monkeypatch.setattr(split_gather, "_take", take)
    storage = tables(300, 8)
    rows = np.arange(256) % 300
    outs = [np.zeros((rows.size, s.shape[1]), dtype=np.uint8) for s in storage]
    with pytest.raises(RuntimeError, match="gather helper failed") as info:
        gather_rows(list(zip(storage, outs)), rows)
    assert isinstance(info.value.__cause__, MemoryError)
    outs = [np.zeros((rows.size, s.shape[1]), dtype=np.uint8) for s in storage]
    monkeypatch.setattr(split_gather, "_take", real)  # later gathers go on, exact
    gather_rows(list(zip(storage, outs)), rows)
    for s, out in zip(storage, outs):
        assert np.array_equal(out, s[rows])


def test_the_chooser_probes_both_ways_then_keeps_the_faster_per_byte():
    c = split_gather.Chooser(round_=10, probe=2)
    picks = []
    for split_cost, single_cost in ((1.0, 3.0), (3.0, 1.0)):  # seconds per byte of each way, per round
        for _ in range(10):
            split = c.pick()
            picks.append(split)
            c.record(split, (split_cost if split else single_cost) * 1000, 1000)
    # each round: two split probes, two single ones, then the faster way for the other six
    assert picks == [True, True, False, False] + [True] * 6 + [True, True, False, False] + [False] * 6


def test_the_chooser_compares_time_per_byte_not_per_gather():
    c = split_gather.Chooser(round_=4, probe=1)
    c.record(c.pick(), 2.0, 4000)  # split: 2 s for 4000 bytes
    c.record(c.pick(), 1.0, 1000)  # single: 1 s for 1000 bytes, slower per byte
    assert c.pick() is True


def test_a_helper_that_runs_late_makes_the_caller_gather_alone(monkeypatch):
    """With the real chooser: a helper that holds each chunk 20 ms (as one the system
    descheduled) makes split gathers slow, so after the probes the caller gathers alone, and
    every batch is exact throughout."""
    monkeypatch.setattr(split_gather, "enabled", True)
    monkeypatch.setattr(split_gather, "SPLIT_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(split_gather, "chooser", split_gather.Chooser(round_=8, probe=2))
    real = split_gather._take
    threads: list[str] = []

    def take(storage, rows, out):
        threads.append(threading.current_thread().name)
        if threads[-1] == "rlink-replay-gather":
            threading.Event().wait(0.02)
        real(storage, rows, out)

    monkeypatch.setattr(split_gather, "_take", take)
    storage = tables(400, 6)
    rng = np.random.default_rng(7)
    for _ in range(5):  # rounds of 8: until the helper got a chunk in a probe (it may wake late)
        used = []
        for _ in range(8):
            rows = rng.integers(0, 400, 128)
            threads.clear()
            outs = [np.zeros((rows.size, s.shape[1]), dtype=np.uint8) for s in storage]
            gather_rows(list(zip(storage, outs)), rows)
            for s, out in zip(storage, outs):
                assert np.array_equal(out, s[rows])
            used.append("rlink-replay-gather" in threads)
        if any(used[:2]):
            break
    assert any(used[:2]), "the helper never took part in the split probes"
    assert not any(used[2:]), "the caller kept splitting although the helper was slow"


@pytest.mark.timeout(60)
def test_replay_batches_are_the_same_split_or_not(monkeypatch):
    """Two replays fed the same steps with the same seed: one gathers on one thread, the other
    split; every batch is identical."""
    monkeypatch.setattr(split_gather, "SPLIT_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(split_gather, "chooser", Always())
    rings = [new_ring(BIG, steps=512, frame=32) for _ in range(2)]
    replays = [ReplayDataset(FakeLearner(ring), capacity=400, batch_size=64, seed=9) for ring in rings]
    rng = np.random.default_rng(5)
    values = {"obs": rng.integers(0, 256, (320, 84, 84, 4), dtype=np.uint8),
              "action": np.arange(320, dtype=np.int64), "done": np.arange(320) % 7 == 0}  # fmt: skip
    for ring in rings:
        for lo in range(0, 320, 32):
            feed(ring, 1, lo, {k: v[lo : lo + 32] for k, v in values.items()})
    for r in replays:
        assert wait_for(lambda r=r: r.inserted == 320)
        assert isinstance(r._core.table, ReplayTable)
    for i in range(20):
        monkeypatch.setattr(split_gather, "enabled", False)
        a = replays[0].sample(5)
        monkeypatch.setattr(split_gather, "enabled", True)
        b = replays[1].sample(5)
        assert torch.equal(a.index, b.index)
        for k in ("obs", "action", "done"):
            assert torch.equal(a[k], b[k]), (i, k)
        assert torch.equal(b["obs"], torch.from_numpy(values["obs"][b.index.numpy()]))
    for r in replays:
        r.close()

"""ReplayDataset's API: argument checks, timeouts, closing, and Batch's new fields."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from rlink_ucx import Batch, Closed, ConfigError, ReplayDataset
from rlink_ucx import TimeoutError as RLinkTimeout
from rlink_ucx.errors import RLinkError
from tests.unit.replay_helpers import FakeLearner, new_ring, put, wait_for


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,match", [
    ({"capacity": 10, "batch_size": 11}, "smaller than batch_size"),
    ({"capacity": 0, "batch_size": 1}, "positive"),
    ({"capacity": 10, "batch_size": 2, "sampler": "lifo"}, "sampler"),
    ({"capacity": 10, "batch_size": 2, "min_size": 11}, "min_size"),
    ({"capacity": 10, "batch_size": 2, "samples_per_insert": -1.0}, "samples_per_insert"),
    ({"capacity": 10, "batch_size": 4, "samples_per_insert": 1.0, "spi_tolerance": 1.0}, "too small"),
    ({"capacity": 10, "batch_size": 2, "priority_exponent": -0.1}, "exponent"),
    ({"capacity": 10, "batch_size": 2, "device": "cuda:0"}, "CUDA"),
])  # fmt: skip
def test_bad_arguments_are_config_errors(kwargs, match):
    if kwargs.get("device") == "cuda:0" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match=match):
        ReplayDataset(FakeLearner(new_ring()), **kwargs)


@pytest.mark.timeout(30)
def test_sample_on_an_empty_replay_raises_the_library_timeout_after_the_timeout():
    with ReplayDataset(FakeLearner(None), capacity=10, batch_size=2, min_size=3) as r:
        started = time.monotonic()
        with pytest.raises(RLinkTimeout, match="no actor has sent a schema"):
            r.sample(0.3)
        assert 0.29 <= time.monotonic() - started < 2
        assert isinstance(RLinkTimeout("x"), TimeoutError) and issubclass(RLinkTimeout, RLinkError)


@pytest.mark.timeout(30)
def test_the_inserter_wakes_on_each_frame_and_stops_promptly_on_close():
    ring = new_ring()
    r = ReplayDataset(FakeLearner(ring), capacity=1000, batch_size=2)
    thread = r._inserter.thread
    for i in range(20):  # each frame is inserted within a few ms (no polling interval)
        started = time.monotonic()
        put(ring, 1, i * 10, 10)
        assert wait_for(lambda i=i: r.inserted == (i + 1) * 10, 5)
        assert time.monotonic() - started < 0.25
    started = time.monotonic()
    r.close()
    assert not thread.is_alive() and time.monotonic() - started < 1.5
    with pytest.raises(Closed):
        r.sample(1)
    r.close()  # idempotent


@pytest.mark.timeout(30)
def test_a_closed_learner_ends_iteration_and_a_sample_that_must_wait_raises_closed():
    ring = new_ring()
    learner = FakeLearner(ring)
    r = ReplayDataset(learner, capacity=100, batch_size=10, sampler="fifo")
    put(ring, 1, 0, 25)
    assert wait_for(lambda: r.inserted == 25)
    learner.closed = True
    ring.close()  # what the learner's close does to its ring
    assert wait_for(lambda: not r._inserter.thread.is_alive())
    assert r.sample(1).seq.tolist() == list(range(10))  # what is held can still be read
    assert r.sample(1).seq.tolist() == list(range(10, 20))
    with pytest.raises(Closed, match="no more steps"):
        r.sample(5)
    assert list(r) == []  # the learner is closed: iteration ends


@pytest.mark.timeout(30)
def test_iteration_yields_samples_and_len_inserted_count_steps():
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=50, batch_size=8) as r:
        assert len(r) == 0 and r.inserted == 0
        put(ring, 1, 0, 80)
        assert wait_for(lambda: r.inserted == 80)
        assert len(r) == 50
        batches = [b for _, b in zip(range(3), r)]
        assert all(b.batch_size == 8 and b.index.min() >= 30 for b in batches)
        assert "held=50" in repr(r)


@pytest.mark.timeout(30)
def test_batch_keeps_working_without_index_and_weight_and_slices_them_with():
    meta = torch.arange(4)
    old = Batch({"x": torch.zeros(4, 2)}, version=meta, actor_id=meta, seq=meta, staleness=meta)
    assert old.index is None and old.weight is None
    assert old.head(2).index is None and old.head(2)["x"].shape == (2, 2)
    new = Batch({"x": torch.zeros(4, 2)}, version=meta, actor_id=meta, seq=meta, staleness=meta,
                index=torch.arange(10, 14), weight=torch.ones(4))  # fmt: skip
    head = new.head(3)
    assert head.index.tolist() == [10, 11, 12] and head.weight.shape == (3,)


@pytest.mark.timeout(30)
def test_a_kept_batch_is_never_overwritten_by_later_samples():
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=500, batch_size=32, seed=2) as r:
        put(ring, 1, 0, 500)
        assert wait_for(lambda: r.inserted == 500)
        kept = [r.sample(5) for _ in range(10)]  # more than the staging pool holds
        copies = [(b["action"].clone(), b.index.clone()) for b in kept]
        for _ in range(20):
            r.sample(5)
        for b, (action, index) in zip(kept, copies):
            assert torch.equal(b["action"], action) and torch.equal(b.index, index)
            np.testing.assert_array_equal(b["action"].numpy(), 1_000_000 + b.index.numpy())

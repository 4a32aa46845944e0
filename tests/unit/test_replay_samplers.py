"""Replay samplers on a real StepRing: uniform, prioritized (frequencies, weights), FIFO, ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlink_ucx import ConfigError, ReplayDataset
from tests.unit.replay_helpers import PRIO_SCHEMA, FakeLearner, new_ring, put, wait_for


def replay(sampler="uniform", capacity=1000, batch_size=50, schema=None, **kw) -> ReplayDataset:
    ring = new_ring(schema) if schema is not None else new_ring()
    return ReplayDataset(FakeLearner(ring), capacity=capacity, batch_size=batch_size, sampler=sampler, seed=3, **kw)


def filled(r: ReplayDataset, n: int, actor: int = 1, **kw) -> ReplayDataset:
    put(r.learner.ring, actor, r.inserted, n, **kw)
    assert wait_for(lambda: r.inserted >= n)
    return r


def check_values(batch) -> None:
    """Every sampled row is the step its metadata names (obs and action encode actor and seq)."""
    obs, action = batch["obs"].numpy(), batch["action"].numpy()
    np.testing.assert_array_equal(obs[..., 0], batch.actor_id.numpy())
    np.testing.assert_array_equal(obs[..., 1], batch.seq.numpy())
    np.testing.assert_array_equal(action, batch.actor_id.numpy() * 1_000_000 + batch.seq.numpy())


@pytest.mark.timeout(60)
def test_uniform_sampling_frequencies_are_flat_and_weights_are_one():
    with filled(replay(capacity=100, batch_size=100), 100) as r:
        counts = np.zeros(100)
        for _ in range(1000):
            b = r.sample(5)
            check_values(b)
            assert b.weight.dtype == torch.float32 and (b.weight == 1).all()
            assert b.index.dtype == torch.int64 and b.index.shape == (100,)
            np.add.at(counts, b.index.numpy(), 1)
        expected = counts.sum() / 100
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 160, chi2  # df 99: P(chi2 > 160) < 1e-4 for a flat law


@pytest.mark.timeout(60)
def test_prioritized_frequencies_follow_priority_to_the_alpha():
    alpha = 0.6
    with filled(replay("prioritized", capacity=40, batch_size=40, priority_exponent=alpha), 40) as r:
        p = np.arange(1, 41, dtype=np.float64)
        r.update_priorities(np.arange(40), p)
        counts = np.zeros(40)
        for _ in range(2000):
            np.add.at(counts, r.sample(5).index.numpy(), 1)
        expected = p**alpha / (p**alpha).sum() * counts.sum()
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 75, chi2  # df 39: P(chi2 > 75) < 1e-3 under the right law
        uniform = counts.sum() / 40
        assert ((counts - uniform) ** 2 / uniform).sum() > 1000  # clearly not flat


@pytest.mark.timeout(60)
def test_importance_weights_are_n_p_to_minus_beta_normalized_by_the_batch_max():
    alpha, beta = 0.7, 0.4
    with filled(replay("prioritized", capacity=64, batch_size=32, priority_exponent=alpha,
                       importance_exponent=beta), 64) as r:  # fmt: skip
        prio = np.linspace(0.1, 5.0, 64)
        r.update_priorities(np.arange(64), prio)
        for _ in range(20):
            b = r.sample(5)
            i = b.index.numpy()
            prob = prio[i] ** alpha / (prio**alpha).sum()
            w = (64 * prob) ** -beta
            np.testing.assert_allclose(b.weight.numpy(), w / w.max(), rtol=1e-5)
            assert b.weight.max() == 1.0


@pytest.mark.timeout(60)
def test_new_steps_get_the_highest_priority_seen_and_actor_priorities_are_used():
    with replay("prioritized", capacity=100, batch_size=10, schema=PRIO_SCHEMA, priority_exponent=1.0) as r:
        pr = np.zeros(50)
        pr[7] = 3.0  # only step 7 has a non-zero priority: it is always drawn
        filled(r, 50, priority=pr)
        b = r.sample(5)
        assert "_priority" not in b, "the reserved field is stripped"
        assert (b.index.numpy() == 7).all()
        r.update_priorities(np.array([7]), np.array([9.0]))
        put(r.learner.ring, 1, 50, 1, priority=np.array([np.nan]))  # a bad priority: treated as the max (9)
        assert wait_for(lambda: r.inserted == 51)
        idx = np.concatenate([r.sample(5).index.numpy() for _ in range(200)])
        assert set(np.unique(idx)) == {7, 50}
        assert 0.35 < (idx == 50).mean() < 0.65  # equal priorities 9 and 9


@pytest.mark.timeout(60)
def test_ids_never_repeat_and_an_update_for_an_evicted_id_is_ignored():
    with replay("prioritized", capacity=100, batch_size=10, priority_exponent=1.0) as r:
        filled(r, 100)
        r.update_priorities(np.arange(100), np.full(100, 1e-6))
        r.update_priorities(np.array([5]), np.array([1.0]))  # id 5 dominates
        assert (r.sample(5).index.numpy() == 5).all()
        put(r.learner.ring, 1, 100, 50)  # evicts ids 0..49; id 105 now sits in id 5's slot
        assert wait_for(lambda: r.inserted == 150)
        r.update_priorities(np.arange(150), np.full(150, 1e-6))
        r.update_priorities(np.array([5]), np.array([1e6]))  # evicted: must not land on id 105
        idx = np.concatenate([r.sample(5).index.numpy() for _ in range(50)])
        assert idx.min() >= 50 and idx.max() < 150
        assert (idx == 105).mean() < 0.2
        assert len(r) == 100 and r.inserted == 150


@pytest.mark.timeout(60)
def test_fifo_hands_out_each_step_once_in_order_and_never_evicts_unread_steps():
    with replay("fifo", capacity=100, batch_size=30) as r:
        ring = r.learner.ring
        put(ring, 1, 0, 250, frame=10)
        assert wait_for(lambda: r.inserted == 100)
        assert r.inserted == 100 and ring.ready_steps() == 150  # the rest waits in the ring
        seen = []
        for _ in range(8):
            b = r.sample(5)
            check_values(b)
            seen.extend(b.seq.tolist())
        assert seen == list(range(240))
        assert np.array_equal(b.index.numpy(), np.arange(210, 240))


@pytest.mark.timeout(30)
def test_bad_priorities_are_refused_and_change_nothing():
    with filled(replay("prioritized", capacity=10, batch_size=5, priority_exponent=1.0), 10) as r:
        r.update_priorities(np.arange(10), np.arange(1.0, 11.0))
        before = r._core.sampler.leaves().copy()
        for bad in ([1.0, -1.0], [np.nan, 1.0], [np.inf, 1.0]):
            with pytest.raises(ConfigError):
                r.update_priorities(np.array([0, 1]), np.array(bad))
        with pytest.raises(ConfigError, match="3 priorities for 2"):
            r.update_priorities(torch.tensor([0, 1]), torch.tensor([1.0, 2.0, 3.0]))
        np.testing.assert_array_equal(r._core.sampler.leaves(), before)
        r.update_priorities(torch.tensor([0]), torch.tensor([0.5]))  # tensors work
        assert r._core.sampler.leaves()[0] == 0.5

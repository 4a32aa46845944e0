"""The sum tree: sums, lookups against a cumulative sum, and sampling frequencies."""

from __future__ import annotations

import numpy as np
import pytest

from rlink_ucx.store.replay.sumtree import SumTree


@pytest.mark.timeout(30)
@pytest.mark.parametrize("capacity", [1, 7, 8, 1000])
def test_total_and_find_agree_with_a_cumulative_sum(capacity):
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity)
    w = rng.random(capacity) * (rng.random(capacity) > 0.3)  # some zero weights
    w[0] = 0.5
    tree.set(np.arange(capacity), w)
    assert tree.total == pytest.approx(w.sum())
    cum = np.cumsum(w)
    draws = rng.random(5000) * w.sum()
    expected = np.searchsorted(cum, draws, side="right")
    got = tree.find(draws)
    # Equal except exactly at an interval's edge (rounding), where both neighbours are right.
    assert (got == expected).mean() > 0.999
    assert (w[got] > 0).all(), "a slot of weight zero was returned"


@pytest.mark.timeout(30)
def test_updates_with_repeated_slots_keep_every_parent_sum_exact():
    rng = np.random.default_rng(1)
    tree = SumTree(100)
    w = np.zeros(100)
    for _ in range(200):
        slots = rng.integers(0, 100, 16)  # repeats on purpose
        values = rng.random(16)
        tree.set(slots, values)
        for s, v in zip(slots, values):
            w[s] = v  # the last value of a repeated slot wins
        assert tree.total == pytest.approx(w.sum())
    np.testing.assert_allclose(tree.get(np.arange(100)), w)
    for node in range(1, tree.size):  # every inner node is the sum of its children
        assert tree.tree[node] == pytest.approx(tree.tree[2 * node] + tree.tree[2 * node + 1])


@pytest.mark.timeout(60)
def test_sampling_frequencies_match_the_weights_within_a_chi_square_bound():
    # 20 slots with weights 1..20 (and one zero); 400k draws. The chi-square statistic over
    # 19 degrees of freedom exceeds 50 with probability < 1e-4 when the law is right (stratified
    # draws make it smaller still); a sampler
    # off by 5% on one slot fails it (tested below).
    rng = np.random.default_rng(7)
    w = np.arange(21, dtype=np.float64)
    tree = SumTree(21)
    tree.set(np.arange(21), w)
    counts = np.zeros(21)
    for _ in range(400):
        np.add.at(counts, tree.sample(rng, 1000), 1)
    assert counts[0] == 0
    expected = w[1:] / w.sum() * counts.sum()
    chi2 = ((counts[1:] - expected) ** 2 / expected).sum()
    assert chi2 < 50, chi2
    skewed = counts[1:].copy()
    skewed[-1] *= 1.05
    assert ((skewed - expected) ** 2 / expected).sum() > 50  # the bound can fail


@pytest.mark.timeout(30)
def test_an_all_zero_tree_refuses_to_sample():
    tree = SumTree(4)
    with pytest.raises(ValueError):
        tree.sample(np.random.default_rng(0), 3)

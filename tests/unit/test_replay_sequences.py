"""Windows of T consecutive steps: one actor, consecutive seq, never across a gap or an eviction."""

from __future__ import annotations

import numpy as np
import pytest

from rlink_ucx import ConfigError, ReplayDataset
from tests.unit.replay_helpers import FakeLearner, new_ring, put, wait_for


def check_windows(b, T: int) -> None:
    actor, seq = b.actor_id.numpy(), b.seq.numpy()
    assert b["obs"].shape[:2] == b["action"].shape == actor.shape == (b.batch_size, T)
    assert (actor == actor[:, :1]).all(), "a window mixes actors"
    assert (np.diff(seq, axis=1) == 1).all(), "a window is not consecutive"
    np.testing.assert_array_equal(b["action"].numpy(), actor * 1_000_000 + seq)
    np.testing.assert_array_equal(b["obs"].numpy()[..., 1], seq)
    assert b.index.shape == (b.batch_size,) and b.weight.shape == (b.batch_size,)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_windows_never_mix_interleaved_actors_nor_cross_a_seq_gap(sampler):
    T = 6
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=2000, batch_size=64, sampler=sampler, sequence_length=T,
                       seed=5) as r:  # fmt: skip
        # Three actors interleaved frame by frame; actor 3 has a gap (seq 40..59 missing) and
        # a stretch shorter than T after it.
        for lo in range(0, 100, 10):
            put(ring, 1, lo, 10, frame=4)
            put(ring, 2, lo, 10, frame=3)
            if not 40 <= lo < 60:
                put(ring, 3, lo, 10 if lo != 60 else 4, frame=10)
        assert wait_for(lambda: r.inserted == 200 + 74)
        seen = set()
        for _ in range(100):
            b = r.sample(5)
            check_windows(b, T)
            seen.update(zip(b.actor_id[:, 0].tolist(), b.seq[:, 0].tolist()))
        starts3 = {s for a, s in seen if a == 3}
        assert all(s + T - 1 < 40 or 70 <= s for s in starts3), "a window crossed actor 3's gap or short stretch"
        assert {a for a, _ in seen} == {1, 2, 3}


@pytest.mark.timeout(60)
def test_a_window_whose_first_step_was_evicted_is_never_returned():
    T = 4
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=50, batch_size=16, sequence_length=T, sampler="prioritized",
                       seed=1) as r:  # fmt: skip
        put(ring, 1, 0, 100, frame=5)  # steps 50..99 held: windows may start at 50 at the earliest
        assert wait_for(lambda: r.inserted == 100)
        for _ in range(100):
            b = r.sample(5)
            check_windows(b, T)
            assert b.seq.min() >= 50 and b.index.min() >= 53


@pytest.mark.timeout(30)
def test_no_whole_window_yet_times_out_with_a_typed_error():
    from rlink_ucx import TimeoutError as RLinkTimeout

    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=100, batch_size=4, sequence_length=8) as r:
        put(ring, 1, 0, 5)
        put(ring, 2, 0, 5)
        assert wait_for(lambda: r.inserted == 10)
        with pytest.raises(RLinkTimeout):
            r.sample(0.2)
        put(ring, 1, 5, 3)  # actor 1 now has 8 consecutive steps: one window
        assert wait_for(lambda: r.inserted == 13)
        b = r.sample(5)
        check_windows(b, 8)
        assert (b.seq.numpy() == np.arange(8)).all()


@pytest.mark.timeout(30)
def test_sequence_length_beyond_capacity_or_with_fifo_is_refused():
    learner = FakeLearner(new_ring())
    with pytest.raises(ConfigError, match="exceeds capacity"):
        ReplayDataset(learner, capacity=10, batch_size=2, sequence_length=11)
    with pytest.raises(ConfigError, match="fifo"):
        ReplayDataset(learner, capacity=10, batch_size=2, sequence_length=3, sampler="fifo")

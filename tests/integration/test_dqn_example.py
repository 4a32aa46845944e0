"""The DQN example (prioritized replay through ReplayDataset, actors in their own processes)
solves CartPole: a greedy mean return of at least 195 over 20 episodes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")


@pytest.mark.slow  # 13-133 s here, and it failed once in a fresh-clone run: not in the default run yet
@pytest.mark.timeout(420)
def test_dqn_with_prioritized_replay_reaches_a_mean_return_of_195():
    # The spawned actor imports the example by name: keep its folder on the path meanwhile.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        import dqn_replay

        # 15-75 s here on 2 cores (one actor process, one learner) depending on the seed; the
        # time cap leaves room for a loaded machine.
        result = dqn_replay.train(actors=1, target=195.0, max_updates=30_000, max_seconds=300.0, seed=0, log=False)
    finally:
        sys.path.pop(0)
    assert result["solved"], result
    assert result["mean_return"] >= 195.0
    assert result["env_steps"] >= 1000 and result["updates"] >= 1000

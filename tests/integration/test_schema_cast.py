"""Two real actor processes: one sets the learner's schema with float32, the other puts Python
lists and float64 / int64 arrays, which arrive cast to it, values equal."""

from __future__ import annotations

import multiprocessing as mp
import queue

import numpy as np
import pytest

from rlink_ucx import Learner, RLinkDataset
from tests.integration.cast_procs import float32_actor, float64_actor

SPAWN = mp.get_context("spawn")
N = 8


@pytest.mark.timeout(120)
def test_another_actors_lists_and_float64_arrive_cast_to_the_learners_schema() -> None:
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=N)
        first = SPAWN.Process(target=float32_actor, args=(learner.address, N))
        first.start()
        batch = dataset.fetch(timeout=60)  # the schema is the first actor's now
        first.join(60)
        assert first.exitcode == 0
        assert batch.actor_id.tolist() == [1] * N
        results = SPAWN.Queue()
        second = SPAWN.Process(target=float64_actor, args=(learner.address, N, results))
        second.start()
        try:
            batch = dataset.fetch(timeout=60)
            errors = results.get(timeout=60)
        except queue.Empty:
            pytest.fail("the second actor reported nothing")
        finally:
            second.join(60)
            if second.is_alive():
                second.kill()
        assert second.exitcode == 0
        assert batch.actor_id.tolist() == [2] * N and batch.seq.tolist() == list(range(N))
        assert str(batch["obs"].dtype) == "torch.float32" and str(batch["action"].dtype) == "torch.int32"
        assert str(batch["reward"].dtype) == "torch.float32"
        expected_obs = np.array([[0.1 * i, 0.2, 0.3, 0.4] for i in range(N)], np.float32)
        np.testing.assert_array_equal(batch["obs"].numpy(), expected_obs)
        assert batch["action"].tolist() == list(range(N))
        np.testing.assert_array_equal(batch["reward"].numpy(), np.array([0.25 * i for i in range(N)], np.float32))
        kind, to_int, shape, info, hello = errors
        assert "field 'obs': learner has float32[4], actor sent bool[4]" in kind
        assert "field 'action': learner has int32[], actor sent float32[]" in to_int
        assert "field 'obs': learner has float32[4], actor sent float64[3]" in shape
        assert "field 'info': unsupported dtype" in info  # named before anything is proposed
        assert "field 'obs': unsupported dtype" in hello  # once the schema is known too

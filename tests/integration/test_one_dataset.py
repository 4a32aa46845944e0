"""A ReplayDataset takes every step as it arrives (its own thread): any other dataset beside it
would silently get part of the stream, so one beside a live ReplayDataset, or a ReplayDataset
beside a live dataset, is refused with a ConfigError that says what to do; once the first is
closed, another may read the learner. RLinkDatasets of different batch sizes may share one
learner (a script fetching from each in turn, e.g. batch 1 to drain the tail)."""

from __future__ import annotations

import numpy as np
import pytest

from rlink_ucx import Actor, CheckpointError, ConfigError, Learner, ReplayDataset, RLinkDataset


@pytest.mark.timeout(120)
def test_a_second_dataset_is_refused_until_the_first_is_closed(tmp_path):
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        first = RLinkDataset(learner, batch_size=4)
        with pytest.raises(ConfigError, match="already has a dataset reading its steps"):
            ReplayDataset(learner, capacity=100, batch_size=4)
        tail = RLinkDataset(learner, batch_size=1)  # the caller fetches from each in turn: allowed
        with Actor(learner.address, transport="tcp") as actor:
            for i in range(8):
                actor.put({"x": np.full(2, i, np.float32)})
            actor.flush(timeout=30)
            assert first.fetch(timeout=30)["x"][:, 0].tolist() == [0, 1, 2, 3]  # the refusal took nothing
            assert tail.fetch(timeout=30)["x"][:, 0].tolist() == [4]
            with pytest.raises(ConfigError):
                ReplayDataset(learner, capacity=100, batch_size=4)  # one RLinkDataset still open
            first.close()
            tail.close()
            replay = ReplayDataset(learner, capacity=100, batch_size=4, prefetch=0)
            with pytest.raises(ConfigError, match="close that one first"):
                RLinkDataset(learner, batch_size=4)
            for i in range(8, 12):
                actor.put({"x": np.full(2, i, np.float32)})
            actor.flush(timeout=30)
            assert set(replay.sample(timeout=30)["x"][:, 0].tolist()) <= set(range(5, 12))
            replay.save(tmp_path / "ck")
            replay.close()
            field = tmp_path / "ck" / "field_0.npy"
            field.write_bytes(field.read_bytes()[:-8])  # truncated: the load fails after taking the feed
            with pytest.raises(CheckpointError):
                ReplayDataset.load(tmp_path / "ck", learner)
            RLinkDataset(learner, batch_size=4).close()  # the failed load left the learner free

"""Iterating a dataset waits for actors that come late, as long as the learner is open."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from rlink_ucx import Config, Learner, RLinkDataset, TimeoutError
from tests.integration.procs import small_actor
from tests.integration.test_datapath import join_all

SPAWN = mp.get_context("spawn")


@pytest.mark.timeout(120)
def test_iteration_waits_past_the_fetch_timeout_for_an_actor_that_comes_late():
    with Learner("127.0.0.1:0", transport="tcp", config=Config(fetch_timeout=0.5)) as learner:
        dataset = RLinkDataset(learner, batch_size=10)
        got: list = []
        errors: list = []

        def consume() -> None:
            try:
                for batch in dataset:
                    got.append(sorted(batch.seq.tolist()))
                    return
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        reader = threading.Thread(target=consume)
        reader.start()
        time.sleep(1.5)  # three fetch timeouts without an actor
        assert reader.is_alive() and not errors, errors
        proc = SPAWN.Process(target=small_actor, args=(learner.address, "tcp", 7, 10))
        proc.start()
        reader.join(60)
        assert join_all([proc]) == [0]
    assert not errors and got == [list(range(10))]


@pytest.mark.timeout(60)
def test_iteration_with_a_timeout_raises_like_fetch():
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=10, timeout=0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            next(iter(dataset))
        assert time.monotonic() - started < 10

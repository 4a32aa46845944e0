"""On-policy calls with real learner and actor processes over tcp: waiting for a newer version,
one step per actor, time-major batches, and the warning when no actor streams."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import warnings

import numpy as np
import pytest

from rlink_ucx import Config, Learner, RLinkDataset, TimeoutError
from tests.integration.onpolicy_procs import (
    T,
    early_weights_reader,
    killable_learner,
    last_version_reader,
    lockstep_actor,
    rollout,
    weights_only_actor,
)
from tests.integration.test_datapath import join_all

SPAWN = mp.get_context("spawn")


def expect(results, kind: str, timeout: float = 60):
    """The next message of ``kind`` from the children (others are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = results.get(timeout=max(0.1, deadline - time.monotonic()))
        if msg[0] == kind or msg[1] == kind:
            return msg


@pytest.mark.timeout(120)
def test_newer_than_returns_the_next_version_and_a_weights_only_actor_learns_the_learner_closed():
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish({"w": np.zeros(4, np.float32)})
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=weights_only_actor, args=(learner.address, results, 60.0))
        proc.start()
        assert expect(results, "first") == ("first", 1)
        time.sleep(0.5)  # the actor waits for a version newer than 1 meanwhile
        learner.publish({"w": np.ones(4, np.float32)})
        _, version, waited = expect(results, "next")
        assert version == 2 and waited >= 0.4  # it waited for version 2, not returned version 1
    # the learner closed: the actor's next read raises Closed (within seconds, not 60 s of version 2)
    _, kind, _, calls = expect(results, "ended", timeout=10)
    assert kind == "Closed" and calls >= 1, (kind, calls)
    assert join_all([proc]) == [0]


@pytest.mark.timeout(120)
def test_the_last_version_published_before_close_is_still_handed_out_then_closed_is_raised():
    # publish(wait=True) saw version 2 delivered, then the learner closed: an actor asking for a
    # version newer than 1 afterwards gets version 2 (the job's last update), not Closed.
    go = SPAWN.Event()
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish({"w": np.zeros(4, np.float32)})
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=last_version_reader, args=(learner.address, results, go))
        proc.start()
        assert expect(results, "first") == ("first", 1)
        assert learner.publish({"w": np.ones(4, np.float32)}, wait=True) == 2
    go.set()
    assert expect(results, "got", timeout=30) == ("got", 2, 4.0)
    assert expect(results, "raised", timeout=30) == ("raised", "Closed")
    assert join_all([proc]) == [0]


@pytest.mark.timeout(120)
def test_a_weights_only_actor_raises_peer_lost_after_its_learner_is_killed():
    results = SPAWN.Queue()
    learner = SPAWN.Process(target=killable_learner, args=(results,))
    learner.start()
    address = results.get(timeout=60)
    actor = SPAWN.Process(target=weights_only_actor, args=(address, results, 2.0))
    actor.start()
    try:
        assert expect(results, "first") == ("first", 1)
        os.kill(learner.pid, signal.SIGKILL)
        learner.join(10)
        # the actor's wait for version 2 ends: the learner is not back within reconnect_timeout
        msg = expect(results, "ended")
        if msg[0] == "next":  # pragma: no cover - reported as a failure below
            pytest.fail(f"a version newer than 1 came from a dead learner: {msg}")
    finally:
        actor.join(30)
        if actor.is_alive():
            actor.kill()
    _, kind, after, _ = msg
    assert kind == "PeerLost", msg
    assert after < 15  # reconnect_timeout is 2 s, heartbeat_timeout 3 s


@pytest.mark.timeout(120)
def test_get_remote_model_before_any_publish_returns_at_once_and_counts_the_import_in_its_timeout():
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=early_weights_reader, args=(learner.address, results))
        proc.start()
        _, state, version, took, policy_version = expect(results, "latest=False")
        assert (state, version, policy_version) == ({}, 0, 0)
        assert took < 1.0
        _, outcome, took, torch_before = expect(results, "timeout=3")
        assert outcome == "TimeoutError" and not torch_before
        assert 2.9 <= took < 3.6, took
        assert join_all([proc]) == [0]


def start_lockstep(learner: Learner, n: int):
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=lockstep_actor, args=(learner.address, i, results)) for i in range(n)]
    for p in procs:
        p.start()
    return procs, results


def puts_of(results, actors: set[int], version: int, timeout: float) -> dict[int, int]:
    """Each of ``actors``' newest version put, once all have put ``version`` (or ``timeout``)."""
    newest: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while any(newest.get(a, 0) < version for a in actors) and time.monotonic() < deadline:
        try:
            actor_id, kind, put_version = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if kind == "put" and actor_id in actors:
            newest[actor_id] = max(newest.get(actor_id, 0), put_version)
    return newest


def check_rollouts(batch, version: int) -> None:
    """Every row is the rollout its actor put for ``version``, whole."""
    for row, actor_id in enumerate(batch.actor_id.tolist()):
        expected = rollout(actor_id, version)
        for name, value in expected.items():
            np.testing.assert_array_equal(np.asarray(batch[name][row]), value)
    assert batch.version.tolist() == [version] * len(batch.actor_id)


@pytest.mark.timeout(180)
def test_one_per_actor_takes_one_rollout_from_each_and_carries_on_without_a_killed_actor():
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish({"w": np.zeros(4, np.float32)})
        dataset = RLinkDataset(learner, batch_size=4, format="numpy")
        procs, results = start_lockstep(learner, 4)
        try:
            batch = dataset.fetch(timeout=90, one_per_actor=True, min_actors=4)
            assert batch.actor_id.tolist() == [0, 1, 2, 3]
            check_rollouts(batch, 1)
            learner.publish({"w": np.ones(4, np.float32)})
            batch = dataset.fetch(timeout=60, one_per_actor=True, min_actors=4)
            assert batch.actor_id.tolist() == [0, 1, 2, 3]
            check_rollouts(batch, 2)
            # actor 3 dies before version 3 exists: it never puts a version-3 rollout
            os.kill(procs[3].pid, signal.SIGKILL)
            procs[3].join(10)
            learner.publish({"w": np.full(4, 2, np.float32)})
            started = time.monotonic()
            batch = dataset.fetch(timeout=20, one_per_actor=True, min_actors=3)
            assert time.monotonic() - started < 15  # not the timeout: actor 3 is gone
            assert batch.actor_id.tolist() == [0, 1, 2]
            check_rollouts(batch, 3)
            # a straggler that is alive but late (stopped): after the timeout, what is here
            os.kill(procs[2].pid, signal.SIGSTOP)
            learner.publish({"w": np.full(4, 3, np.float32)})
            started = time.monotonic()
            batch = dataset.fetch(timeout=3, one_per_actor=True, min_actors=2)
            assert 2.9 <= time.monotonic() - started < 8
            assert batch.actor_id.tolist() == [0, 1]
            check_rollouts(batch, 4)
            # fewer than min_actors by the timeout: TimeoutError, nothing taken
            learner.publish({"w": np.full(4, 4, np.float32)})
            with pytest.raises(TimeoutError, match="min_actors=3"):
                dataset.fetch(timeout=3, one_per_actor=True, min_actors=3)
            # ... while the others act on version 5 at once: the frozen actor, which confirms
            # no version, holds none back (it did, for weights_timeout per version)
            assert puts_of(results, {0, 1}, 5, timeout=2) == {0: 5, 1: 5}
            # Resumed, actor 2 acts with the newest version it finds, 4 or already 5 (the newest
            # supersedes an older one still arriving); the others' pending rollouts are version 5's.
            os.kill(procs[2].pid, signal.SIGCONT)
            batch = dataset.fetch(timeout=30, one_per_actor=True, min_actors=3)
            assert batch.actor_id.tolist() == [0, 1, 2]
            assert batch.version.tolist()[:2] == [5, 5] and batch.version.tolist()[2] in (4, 5)
        finally:
            os.kill(procs[2].pid, signal.SIGCONT)  # a test that failed while it was stopped
            learner.close()
            assert join_all(procs[:3]) == [0, 0, 0]
            procs[3].join(1)


@pytest.mark.timeout(120)
def test_one_per_actor_holds_more_actors_than_batch_size():
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish({"w": np.zeros(4, np.float32)})
        dataset = RLinkDataset(learner, batch_size=2, format="numpy")
        procs, _ = start_lockstep(learner, 3)
        try:
            batch = dataset.fetch(timeout=90, one_per_actor=True, min_actors=3)
            assert batch.actor_id.tolist() == [0, 1, 2] and batch["obs"].shape == (3, T + 1, 3)
            check_rollouts(batch, 1)
        finally:
            learner.close()
            assert join_all(procs) == [0, 0, 0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["torch", "numpy", "jax", "tensorflow"])
def test_time_major_batches(fmt: str):
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish({"w": np.zeros(4, np.float32)})
        dataset = RLinkDataset(learner, batch_size=3, format=fmt, time_major=True)
        procs, _ = start_lockstep(learner, 3)
        try:
            batch = dataset.fetch(timeout=90, one_per_actor=True, min_actors=3)
            obs, reward, first = (np.asarray(batch[k]) for k in ("obs", "reward", "first"))
            assert obs.shape == (T + 1, 3, 3) and reward.shape == (T, 3) and first.shape == (3,)
            assert np.asarray(batch.actor_id).shape == (3,)
            for b, actor_id in enumerate(np.asarray(batch.actor_id).tolist()):
                expected = rollout(actor_id, 1)
                np.testing.assert_array_equal(obs[:, b], expected["obs"])
                np.testing.assert_array_equal(reward[:, b], expected["reward"])
                assert first[b] == expected["first"]
            assert obs.flags["C_CONTIGUOUS"]
        finally:
            learner.close()
            assert join_all(procs) == [0, 0, 0]


@pytest.mark.timeout(60)
def test_fetch_warns_when_no_actor_has_connected():
    config = Config(fetch_warn_after=0.5)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=10)
        with pytest.warns(UserWarning, match="no actor has connected") as caught, pytest.raises(TimeoutError):
            dataset.fetch(timeout=2)
        assert len([w for w in caught if "no actor" in str(w.message)]) == 1  # once per wait


@pytest.mark.timeout(90)
def test_fetch_warns_once_every_actor_has_gone_and_not_while_one_streams():
    config = Config(fetch_warn_after=0.5)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        learner.publish({"w": np.zeros(4, np.float32)})
        dataset = RLinkDataset(learner, batch_size=10, format="numpy")
        first, _ = start_lockstep(learner, 1)  # one rollout per version: 1 step, then it waits
        later: list = []
        try:
            assert dataset.fetch(timeout=60, one_per_actor=True).actor_id.tolist() == [0]
            os.kill(first[0].pid, signal.SIGKILL)
            first[0].join(10)
            gone = pytest.warns(UserWarning, match="every actor has gone")
            with gone as caught, pytest.raises(TimeoutError, match="0 of 10 steps ready"):
                dataset.fetch(timeout=2)
            assert len([w for w in caught if "no actor" in str(w.message)]) == 1  # once per wait
            later, _results = start_lockstep(learner, 1)  # actor 0 again, a new process
            assert dataset.fetch(timeout=60, one_per_actor=True).actor_id.tolist() == [0]
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a warning here fails the test
                with pytest.raises(TimeoutError):
                    dataset.fetch(timeout=2)  # an actor is connected (waiting for version 2)
        finally:
            learner.close()
            assert join_all(later) == [0] * len(later)


@pytest.mark.timeout(30)
def test_min_actors_needs_one_per_actor():
    from rlink_ucx import ConfigError

    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=4)
        with pytest.raises(ConfigError, match="min_actors"):
            dataset.fetch(timeout=1, min_actors=2)
        with pytest.raises(ConfigError, match="min_actors"):
            dataset.fetch(timeout=1, one_per_actor=True, min_actors=0)

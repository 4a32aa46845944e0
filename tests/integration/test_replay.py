"""ReplayDataset with real actor processes over real sockets: every step, priorities from the
actors, windows, backpressure from the rate limiter, and checkpoints taken while steps arrive."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from rlink_ucx import Config, Learner, ReplayDataset
from tests.conftest import TRANSPORTS
from tests.integration.procs import encoded_steps
from tests.integration.replay_procs import frame_of, frames_actor, priority_of, replay_actor
from tests.integration.test_datapath import join_all

SPAWN = mp.get_context("spawn")


def start(*procs):
    for p in procs:
        p.start()
    return list(procs)




def held(replay: ReplayDataset) -> dict[str, np.ndarray]:
    """Everything the table holds, oldest first: metadata and raw field rows."""
    t = replay._core.table
    ids = np.arange(t.first, t.inserted)
    _, actor, seq = t.meta(ids)
    rows = {spec.name: r[ids % t.capacity] for spec, r in zip(t.schema.fields, t.rows)}
    return {"ids": ids, "actor": actor, "seq": seq, **rows}


def check_stream(h: dict[str, np.ndarray], actor: int, n: int) -> None:
    """The table holds actor ``actor``'s ``n`` steps once each, in order, bit for bit."""
    mine = h["actor"] == actor
    assert h["seq"][mine].tolist() == list(range(n)), f"actor {actor}: steps missing, duplicated or reordered"
    expected = encoded_steps(actor, n)
    for name in ("obs", "action", "reward", "done"):
        assert h[name][mine].tobytes() == np.ascontiguousarray(expected[name]).tobytes(), name


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_actor_processes_fill_a_prioritized_replay_with_their_priorities(transport):
    n = 3000
    with Learner("127.0.0.1:0", transport=transport) as learner:
        replay = ReplayDataset(learner, capacity=2 * n, batch_size=64, sampler="prioritized", priority_exponent=1.0,
                               seed=0)  # fmt: skip
        procs = start(*(SPAWN.Process(target=replay_actor, args=(learner.address, transport, a, n)) for a in (1, 2)))
        batch = replay.sample(timeout=60)
        assert "_priority" not in batch and batch.weight.shape == (64,)
        assert join_all(procs, 90) == [0, 0]
        deadline = time.monotonic() + 30
        while replay.inserted < 2 * n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert replay.inserted == 2 * n and len(replay) == 2 * n
        h = held(replay)
        for a in (1, 2):
            check_stream(h, a, n)
        leaves = replay._core.sampler.tree.get(h["ids"] % replay._core.table.capacity)
        np.testing.assert_allclose(leaves, priority_of(h["actor"], h["seq"]), rtol=1e-6)  # the actors' priorities
        b = replay.sample(timeout=10)
        np.testing.assert_array_equal(b["action"].numpy(), b.actor_id.numpy() * 1_000_000 + b.seq.numpy())
        replay.close()


@pytest.mark.timeout(120)
def test_windows_from_interleaved_actor_processes_never_mix_actors():
    n, T = 2000, 16
    with (
        Learner("127.0.0.1:0", transport="tcp") as learner,
        ReplayDataset(learner, capacity=4 * n, batch_size=32, sequence_length=T, seed=1) as replay,
    ):
        procs = start(*(SPAWN.Process(target=replay_actor, args=(learner.address, "tcp", a, n, None, 0.001))
                        for a in (1, 2)))  # fmt: skip
        actors = set()
        while any(p.is_alive() for p in procs) or replay.inserted < 2 * n:
            b = replay.sample(timeout=60)
            actor, seq = b.actor_id.numpy(), b.seq.numpy()
            assert (actor == actor[:, :1]).all() and (np.diff(seq, axis=1) == 1).all()
            np.testing.assert_array_equal(b["action"].numpy(), actor * 1_000_000 + seq)
            actors.update(actor[:, 0].tolist())
            if replay.inserted >= 2 * n:
                break
        assert join_all(procs, 90) == [0, 0]
        assert actors == {1, 2}


@pytest.mark.timeout(180)
def test_a_rate_limiter_that_holds_inserts_back_slows_the_actor_and_loses_nothing():
    n, b, pace = 4000, 20, 0.01  # the learner samples 20 items per 10 ms: ~2000 inserts/s at s = 1
    # A small ring (~600 steps of 27 bytes) fills quickly: credits stop, the actor waits.
    config = Config(buffer_bytes=16 * 1024, frame_bytes=4096)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner, \
            ReplayDataset(learner, capacity=2 * n, batch_size=b, samples_per_insert=1.0, min_size=200,
                          spi_tolerance=100, sampler="uniform") as replay:  # fmt: skip
        results = SPAWN.Queue()
        procs = start(
            SPAWN.Process(target=replay_actor, args=(learner.address, "tcp", 1, n, results, 0.0, 120.0, 4096))
        )
        samples = 0
        while replay.inserted < n:
            replay.sample(timeout=60)
            samples += 1
            diff = replay.inserted - replay.sampled
            assert 200 - 100 <= diff <= 200 + 100, diff  # s*m +- e, exactly
            time.sleep(pace)
        report = results.get(timeout=60)
        assert join_all(procs, 90) == [0]
        h = held(replay)
        check_stream(h, 1, n)  # every step, once, in order: nothing was dropped
        assert report["lost"] == 0 and report["acked"] == n
        # Without the limiter the actor puts 4000 small steps in well under a second here;
        # held to ~2000 inserts/s it takes ~(4000 - 300 - 600 in the ring) / 2000 s.
        assert report["seconds"] > 1.0, report
        assert report["credit_waits"] > 0, report


@pytest.mark.timeout(180)
def test_save_while_actors_put_then_load_and_continue_loses_nothing(tmp_path):
    n = 12_000
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        replay = ReplayDataset(learner, capacity=2 * n, batch_size=32, sampler="prioritized", seed=0)
        procs = start(*(SPAWN.Process(target=replay_actor, args=(learner.address, "tcp", a, n, None, 0.002))
                        for a in (1, 2)))  # fmt: skip
        deadline = time.monotonic() + 60
        while replay.inserted < 2000 and time.monotonic() < deadline:
            time.sleep(0.01)
        replay.save(tmp_path / "mid")  # while both actors keep putting
        during = replay.inserted
        assert during < 2 * n, "the actors finished before the save: nothing was tested"
        replay.close()  # stop taking steps: the rest waits in the learner (the actors on credit)
        replay.save(tmp_path / "last")
        resumed = ReplayDataset.load(tmp_path / "last", learner, seed=1)
        resumed.sample(timeout=10)
        assert join_all(procs, 120) == [0, 0]
        deadline = time.monotonic() + 30
        while resumed.inserted < 2 * n and time.monotonic() < deadline:
            time.sleep(0.02)
        h = held(resumed)
        for a in (1, 2):
            check_stream(h, a, n)
        assert resumed.inserted == 2 * n
        resumed.close()  # a replay reads its learner alone: the next one may load once it is closed
        # The mid-stream checkpoint is a consistent prefix of each stream, and loads too.
        with ReplayDataset.load(tmp_path / "mid", learner) as mid:
            hm = held(mid)
            assert 2000 <= len(mid) <= during
            for a in (1, 2):
                seq = hm["seq"][hm["actor"] == a]
                assert seq.tolist() == list(range(len(seq)))
                expected = encoded_steps(a, n)["action"][: len(seq)]
                np.testing.assert_array_equal(hm["action"][hm["actor"] == a].view(np.int64).ravel(), expected)


@pytest.mark.timeout(180)
def test_large_steps_taken_whole_from_the_ring_arrive_bit_for_bit_and_survive_a_reload(tmp_path):
    """Atari-sized steps fill whole ring chunks, which a host table takes without copying
    (BlockTable): every held byte, the priorities, and a close/save/load on the same learner."""
    from rlink_ucx.store.replay.block_table import BlockTable

    n = 2500
    config = Config(buffer_bytes=16 << 20)  # a ring of 768 steps: small next to the table
    with Learner("127.0.0.1:0", transport="shm", config=config) as learner:
        replay = ReplayDataset(learner, capacity=4000, batch_size=64, sampler="prioritized", priority_exponent=1.0)
        procs = start(*(SPAWN.Process(target=frames_actor, args=(learner.address, a, n)) for a in (1, 2)))
        replay.sample(timeout=60)
        deadline = time.monotonic() + 60
        while replay.inserted < n and time.monotonic() < deadline:
            time.sleep(0.01)
        replay.close()  # mid-stream: the rest waits in the learner
        replay.save(tmp_path / "c")
        resumed = ReplayDataset.load(tmp_path / "c", learner)
        assert join_all(procs, 120) == [0, 0]
        deadline = time.monotonic() + 60
        while resumed.inserted < 2 * n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert resumed.inserted == 2 * n and len(resumed) == 4000
        for r in (replay, resumed):
            t = r._core.table
            assert isinstance(t, BlockTable)
            ids = np.arange(t.first, t.inserted)
            _, actor, seq = t.meta(ids)
            obs = np.empty((ids.size, 84 * 84 * 4), dtype=np.uint8)
            action = np.empty((ids.size, 8), dtype=np.uint8)
            t.gather(ids, [obs, action])
            np.testing.assert_array_equal(action.view(np.int64).ravel(), actor * 1_000_000 + seq)
            for a in (1, 2):
                mine = actor == a
                np.testing.assert_array_equal(obs[mine].reshape(-1, 84, 84, 4), frame_of(a, seq[mine]))
            leaves = r._core.sampler.tree.get(ids % t.capacity)
            np.testing.assert_allclose(leaves, priority_of(actor, seq), rtol=1e-6)
        assert replay._core.table.adopted + resumed._core.table.adopted > 2000  # most steps without a copy
        b = resumed.sample(timeout=10)
        np.testing.assert_array_equal(b["action"].numpy(), b.actor_id.numpy() * 1_000_000 + b.seq.numpy())
        resumed.close()


@pytest.mark.timeout(180)
def test_batches_drawn_ahead_hold_whole_rows_while_actor_processes_overwrite_the_table():
    """The default uniform replay draws batches ahead on two threads, copying rows outside the
    replay's lock, while two actor processes stream 8x its capacity of Atari-sized steps
    through it: every row of every batch is the step its metadata names, byte for byte."""
    n, capacity = 4000, 1024
    with Learner("127.0.0.1:0", transport="shm") as learner:
        replay = ReplayDataset(learner, capacity=capacity, batch_size=64)
        assert replay.prefetch == 2
        procs = start(*(SPAWN.Process(target=frames_actor, args=(learner.address, a, n)) for a in (1, 2)))
        batches, evicted = 0, 0
        while any(p.is_alive() for p in procs) or batches < 20:
            b = replay.sample(timeout=60)
            actor, seq = b.actor_id.numpy(), b.seq.numpy()
            assert np.array_equal(b["obs"].numpy(), frame_of(actor.reshape(-1, 1), seq))
            assert np.array_equal(b["action"].numpy(), actor * 1_000_000 + seq)
            batches += 1
            evicted = max(evicted, replay.inserted - len(replay))
        assert join_all(procs, 90) == [0, 0]
        deadline = time.monotonic() + 30
        while replay.inserted < 2 * n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert replay.inserted == 2 * n and len(replay) == capacity and evicted > 0
        replay.close()

"""Many actors at once, and the connections that must not crowd them out: a storm of actors
connecting together, a slowloris, more actors than max_connections. Real processes, tcp."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest

from rlink_ucx import Actor, Config, ConnectError, Learner, RLinkDataset
from tests.integration.procs import storm_actors

SPAWN = mp.get_context("spawn")


def drain(dataset: RLinkDataset, total: int, timeout: float) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while len(got) < total and time.monotonic() < deadline:
        try:
            got += dataset.fetch(timeout=1)["x"].tolist()
        except Exception:  # noqa: BLE001 - TimeoutError while actors are still connecting
            continue
    return got


@pytest.mark.timeout(180)
def test_a_storm_of_actors_all_connect_and_every_step_arrives_once():
    procs, per_proc, steps = 4, 12, 50
    # Few handshakes may be in flight: most actors are turned away at first and must retry.
    config = Config(max_handshakes=4)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=50)
        results = SPAWN.Queue()
        workers = [SPAWN.Process(target=storm_actors, args=(learner.address, 1 + p * per_proc, per_proc, steps,
                                                            {"handshake_timeout": 5.0}, results))
                   for p in range(procs)]  # fmt: skip
        for w in workers:
            w.start()
        try:
            outcomes = [results.get(timeout=150) for _ in range(procs * per_proc)]
            got = drain(dataset, procs * per_proc * steps, 60)
        finally:
            for w in workers:
                w.join(10)
                w.kill()
        stats = learner.stats()
    assert sorted(outcomes) == sorted(("ok", i) for i in range(1, 1 + procs * per_proc)), outcomes
    expected = sorted(a * 1_000_000 + s for a in range(1, 1 + procs * per_proc) for s in range(steps))
    assert sorted(got) == expected  # every step once
    assert stats["shed_handshakes"] > 0, "the storm never hit max_handshakes: the test proves nothing"


@pytest.mark.timeout(120)
def test_a_slowloris_never_locks_out_a_real_actor():
    # Handshakes may take 60 s here, and only 16 may be in flight: 100 silent sockets would hold
    # every slot for a minute if the learner kept the first ones.
    config = Config(max_handshakes=16, handshake_timeout=60)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        host, port = learner.address.rsplit(":", 1)
        dataset = RLinkDataset(learner, batch_size=100)
        silent = [socket.create_connection((host, int(port))) for _ in range(100)]
        try:
            started = time.monotonic()
            with Actor(learner.address, transport="tcp", config=Config(handshake_timeout=60)) as actor:
                connected = time.monotonic() - started
                actor.put_many({"x": list(range(100))})
                actor.flush(30)
            assert dataset.fetch(timeout=30)["x"].tolist() == list(range(100))
            stats = learner.stats()
        finally:
            for s in silent:
                s.close()
    assert connected < 10, f"the actor waited {connected:.1f}s behind silent connections"
    assert stats["shed_handshakes"] >= 84 and stats["handshakes_in_flight"] <= 16, stats


@pytest.mark.timeout(120)
def test_more_actors_than_max_connections_are_turned_away_with_a_clear_error():
    config = Config(max_connections=3)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=30)
        admitted = [Actor(learner.address, transport="tcp") for _ in range(3)]
        started = time.monotonic()
        with pytest.raises(ConnectError, match=r"tried for 2s.*max_connections=3 actors"):
            Actor(learner.address, transport="tcp", config=Config(connect_timeout=2.0))
        assert 1.9 < time.monotonic() - started < 10
        for i, a in enumerate(admitted):  # the admitted ones lost nothing meanwhile
            a.put_many({"x": [i] * 10})
            a.flush(10)
        assert sorted(dataset.fetch(timeout=10)["x"].tolist()) == [0] * 10 + [1] * 10 + [2] * 10
        admitted.pop().close()  # a slot frees up: a waiting actor gets it
        with Actor(learner.address, transport="tcp", config=Config(connect_timeout=30.0)) as late:
            late.put({"x": 7})
            late.flush(10)
        stats = learner.stats()
        for a in admitted:
            a.close()
    assert stats["rejected_connections"] >= 1


@pytest.mark.timeout(120)
def test_actors_of_one_process_share_one_io_thread_and_idle_ones_never_wake():
    from tests.integration.procs import many_actors_one_process

    count = 16
    # The default config: 16 actors of 8-byte steps used to ask for more credit than the ring
    # holds, and the last ones waited until close dropped their step (3 runs in 4).
    with Learner("127.0.0.1:0") as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=many_actors_one_process, args=(learner.address, count, results))
        proc.start()
        try:
            report = results.get(timeout=90)
            got = drain(dataset, 2 * count + (count // 2) * 10, 30)
        finally:
            proc.join(10)
            proc.kill()
    ids = [100 + i for i in range(count)]
    expected = [a * 1000 + k for a in ids for k in (0, 500)]
    expected += [a * 1000 + k for a in ids[count // 2 :] for k in range(1, 11)]
    assert sorted(got) == sorted(expected)  # the closes of half the actors disturbed no one
    # One I/O thread for all 16 actors (the shm plane may add one executor thread), none left after.
    assert 1 <= report["threads"] <= 3, report
    assert report["threads_after_close"] == 0, report
    # A step put while the I/O side is idle leaves at once, on the caller's thread: no linger
    # timer. The first step may have found no credit yet (it came with the schema's answer): it
    # waited for the timer, which then stopped. An idle actor does not wake (it used to tick
    # every frame_linger, 200 times a second).
    assert report["ticks_after_step"] <= 10, report
    assert report["ticks_after_second"] == 0, report
    assert report["idle_ticks"] == 0, report

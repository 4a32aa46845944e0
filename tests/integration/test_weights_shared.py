"""Weights for actors on the learner's host: read from its shared memory, verified, with a
fall back to the actor's weights stream where that fails. Real learner and actor processes."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest

from rlink_ucx import Config, Learner
from tests.integration.test_datapath import join_all
from tests.integration.test_weights_security import TOKEN, digest, model, wait_subscribed, watch_versions

SPAWN = mp.get_context("spawn")


def reading_actor(address: str, results: Any, until: int, leave: Any, fault: str | None = None,
                  shared: bool = True) -> None:  # fmt: skip
    """Subscribes, records a digest of every version it is handed, reports. ``fault``: what
    goes wrong with its shared-memory reads ("altered": a byte changes after the read, as if
    another process wrote into the buffer; "unreadable": the buffer cannot be opened)."""
    from rlink_ucx import Actor
    from rlink_ucx.weights import subscriber

    original = subscriber.read_into

    def faulty(where: Any, dst: np.ndarray, on_piece: Any = None) -> None:
        if fault == "unreadable":
            raise PermissionError("not ours to open")
        original(where, dst, None)
        dst[0] ^= 0xFF
        if on_piece is not None:
            on_piece(len(dst))

    if fault is not None:
        subscriber.read_into = faulty
    config = Config(weights_timeout=20, weights_shared_memory=shared)
    with Actor(address, token=TOKEN, transport="tcp", subscribe=True, config=config) as actor:
        seen, error = watch_versions(actor, until)
        results.put({"seen": seen, "error": error, "stats": actor.stats()["weights"], "fault": fault,
                     "shared": shared})  # fmt: skip
        leave.wait(60)


def run_versions(versions: int, actors: list[tuple[str | None, bool]]) -> tuple[list[dict], dict]:
    """Publish ``versions`` versions to actors started as ``(fault, shared)``; their reports
    (sorted as ``actors``) and the learner's weights stats."""
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=Config(weights_timeout=20)) as learner:
        results, leave = SPAWN.Queue(), SPAWN.Event()
        procs = []
        for fault, shared in actors:
            procs.append(SPAWN.Process(target=reading_actor, args=(learner.address, results, versions, leave,
                                                                   fault, shared)))  # fmt: skip
            procs[-1].start()
        wait_subscribed(learner, len(procs))
        for v in range(1, versions + 1):
            assert learner.publish(model(v), wait=True, timeout=60) == v
        reports = [results.get(timeout=60) for _ in procs]
        leave.set()
        assert join_all(procs) == [0] * len(procs)
        reports.sort(key=lambda r: actors.index((r["fault"], r["shared"])))
        return reports, learner.stats()["weights"]


@pytest.mark.timeout(180)
def test_actors_on_the_learners_host_read_every_version_from_its_shared_memory():
    reports, stats = run_versions(5, [(None, True)] * 3)
    for r in reports:
        assert r["error"] is None, r
        assert r["seen"] and all(d == digest(model(v)) for v, d in r["seen"].items()), r["seen"]
        assert max(r["seen"]) == 5 and sorted(r["seen"]) == list(r["seen"]), r["seen"]
        # The first version may come on the weights stream every new subscriber opens; the rest are read.
        assert r["stats"]["shared_reads"] >= 4 and r["stats"]["streamed"] <= 1, r["stats"]
        assert r["stats"]["rejected"] == 0 and r["stats"]["failures"] == 0, r["stats"]
    assert stats["streams"] == 0 and stats["shared"] >= 12, stats  # no weights stream kept


@pytest.mark.timeout(180)
def test_an_actor_that_does_not_read_shared_memory_gets_versions_on_its_connection_beside_those_that_do():
    reports, stats = run_versions(4, [(None, False), (None, True), (None, True)])
    for r in reports:
        assert r["error"] is None and all(d == digest(model(v)) for v, d in r["seen"].items()), r
    assert reports[0]["stats"]["streamed"] >= 4 and reports[0]["stats"]["shared_reads"] == 0, reports[0]
    assert reports[0]["stats"]["connections"] == 1, reports[0]  # one kept connection carried them all
    for r in reports[1:]:
        assert r["stats"]["shared_reads"] >= 3 and r["stats"]["streamed"] <= 1, r["stats"]
    assert stats["shared"] >= 6, stats


@pytest.mark.timeout(180)
def test_bytes_altered_in_shared_memory_are_refused_and_the_actor_streams_the_real_version():
    reports, _ = run_versions(3, [("altered", True), (None, True)])
    bad, good = reports
    assert bad["error"] is None, bad
    assert bad["seen"] and all(d == digest(model(v)) for v, d in bad["seen"].items()), bad["seen"]
    assert bad["stats"]["shared_reads"] == 0 and bad["stats"]["rejected"] >= 2, bad["stats"]
    assert bad["stats"]["streamed"] >= 3, bad["stats"]  # every version, the real one, by stream
    assert good["stats"]["shared_reads"] >= 2 and good["stats"]["rejected"] == 0, good["stats"]


@pytest.mark.timeout(180)
def test_an_actor_that_cannot_open_the_shared_memory_falls_back_for_good():
    reports, stats = run_versions(4, [("unreadable", True)])
    (r,) = reports
    assert r["error"] is None and all(d == digest(model(v)) for v, d in r["seen"].items()), r
    assert max(r["seen"]) == 4 and r["stats"]["shared_reads"] == 0, r
    # One failed read, then the learner stops offering it: the next versions come on a kept
    # weights stream.
    assert r["stats"]["failures"] == 1 and r["stats"]["streamed"] >= 3, r["stats"]
    assert stats["shared"] == 1, stats


def latest_caller(address: str, results: Any, calls: int) -> None:
    """Calls get_remote_model(latest=True) ``calls`` times while the learner keeps publishing;
    reports the versions it got and how long the slowest call took."""
    import threading

    from rlink_ucx import Actor, RLinkError

    def spin() -> None:  # an env stepping in another thread: the caller waits its turn for the GIL
        while True:
            pass

    threading.Thread(target=spin, daemon=True).start()
    got, slowest, error = [], 0.0, None
    with Actor(address, token=TOKEN, transport="tcp", subscribe=True) as actor:
        actor.get_remote_model(timeout=60)
        for _ in range(calls):
            started = time.monotonic()
            try:
                _, version = actor.get_remote_model(timeout=20)
            except RLinkError as exc:
                error = f"{type(exc).__name__}: {exc}"
                break
            slowest = max(slowest, time.monotonic() - started)
            got.append(version)
        results.put({"got": got, "slowest": slowest, "error": error})


@pytest.mark.timeout(180)
def test_get_remote_model_latest_returns_while_the_learner_keeps_publishing():
    """latest=True waits for the version announced when the call began, not for one announced
    meanwhile: a call that chased every newer announcement could wait until its timeout while a
    learner publishes faster than the actor takes versions in (the caller here also competes
    for the GIL with a busy thread, as an actor stepping envs does)."""
    import threading

    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=Config(weights_timeout=20)) as learner:
        learner.publish(model(1))
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=latest_caller, args=(learner.address, results, 30))
        proc.start()
        stop = threading.Event()

        def keep_publishing() -> None:
            v = 1
            while not stop.is_set():
                v += 1
                learner.publish(model(v))  # returns at once: the newest pending version wins
                time.sleep(0.001)

        publisher = threading.Thread(target=keep_publishing)
        publisher.start()
        try:
            report = results.get(timeout=150)
        finally:
            stop.set()
            publisher.join(10)
        assert join_all([proc]) == [0]
    assert report["error"] is None, report
    assert len(report["got"]) == 30 and report["got"] == sorted(report["got"]), report
    assert report["slowest"] < 10, report


@pytest.mark.timeout(180)
def test_bytes_written_into_shared_memory_before_the_learner_tags_them_are_never_accepted(monkeypatch):
    """Another process of the user writes +inf into the version's memfd at the moment the
    learner tags it (issue 40, finding 4: tags taken from the memfd vouched for those bytes,
    and actors loaded them). Tags come from the learner's private copy: no version an actor
    accepts differs from what was published."""
    import os

    from rlink_ucx.transport.shm.memory import DATA_OFFSET
    from rlink_ucx.weights import mac

    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=Config(weights_timeout=20)) as learner:
        results, leave = SPAWN.Queue(), SPAWN.Event()
        proc = SPAWN.Process(target=reading_actor, args=(learner.address, results, 3, leave))
        proc.start()
        wait_subscribed(learner, 1)
        publisher = learner._server.publisher
        writes: list[int] = []
        original = mac.BucketTagger.update

        def write_then_tag(tagger: Any, data: Any) -> None:
            snap = publisher.pending
            if snap is not None and snap.shared is not None and not snap.sealed and snap.version < 3:
                pid, fd, _, size = snap.shared
                other = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)  # as another process would
                try:
                    os.pwrite(other, np.full(size // 4, np.inf, dtype=np.float32).tobytes(), DATA_OFFSET)
                finally:
                    os.close(other)
                writes.append(snap.version)
            original(tagger, data)

        monkeypatch.setattr(mac.BucketTagger, "update", write_then_tag)  # the fill tags each piece with it
        learner.publish(model(1), wait=True, timeout=25)
        learner.publish(model(2), wait=True, timeout=25)
        assert learner.publish(model(3), wait=True, timeout=60) == 3
        report = results.get(timeout=60)
        leave.set()
        assert join_all([proc]) == [0]
    assert 1 in writes and 2 in writes, writes
    assert report["error"] is None, report
    assert 3 in report["seen"], report["seen"]
    assert all(d == digest(model(v)) for v, d in report["seen"].items()), report["seen"]

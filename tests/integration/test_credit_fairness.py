"""Credit is shared fairly: actors that connect while others hold a large window get credit at
once, because the early actors' window shrinks to a fair share (real processes, tcp, default
config)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from rlink_ucx import Closed, Learner, RLinkDataset
from rlink_ucx import TimeoutError as RLinkTimeout
from tests.integration.credit_procs import busy_actors, late_actors

SPAWN = mp.get_context("spawn")


@pytest.mark.timeout(150)
def test_actors_joining_while_others_are_busy_get_a_fair_share_of_credit():
    # Before fair windows, two actors of 8-byte steps held 32 MiB of credit each (the whole
    # 64 MiB ring) for as long as they kept sending, and the others got credit only as fast
    # as those two spent theirs.
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=1, stop_when_actors_done=True)
        results = SPAWN.Queue()
        late_ids = list(range(10, 24))
        workers = [SPAWN.Process(target=busy_actors, args=(learner.address, [1, 2], 6.0, results)),
                   SPAWN.Process(target=late_actors, args=(learner.address, late_ids, 1.5, results))]
        for w in workers:
            w.start()
        late_steps: set[int] = set()
        busy_steps = 0
        reports: dict = {}
        books = None
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            try:
                x = dataset.fetch(timeout=0.2)["x"]
                busy_steps += int((x == -1).sum())
                late_steps.update(x[x >= 0].tolist())
            except Closed:  # every actor has finished
                break
            except RLinkTimeout:
                pass
            while not results.empty():
                reports.update(results.get())
            if books is None and "late_flush_s" in reports:  # all 16 still connected
                stats = learner.stats()
                books = (stats["buffer"]["capacity_bytes"] // 8, [a["credit"] for a in stats["actors"]])
        while len(reports) < 2:
            reports.update(results.get(timeout=30))
        for w in workers:
            w.join(20)
            w.kill()
    assert late_steps == set(late_ids)
    assert busy_steps == reports["busy_steps"] > 0
    assert books is not None, "the late actors never reported"
    capacity, credits = books
    assert len(credits) == 16
    fair = capacity // (2 * 16)  # the ring's half, shared by 16; less than a quarter more is not taken back
    assert max(credits) < fair * 5 // 4, credits
    assert sum(credits) <= capacity // 2 + 16 * fair // 4, credits
    assert max(reports["late_flush_s"]) < 10.0, reports["late_flush_s"]  # 15 s raises in the actor

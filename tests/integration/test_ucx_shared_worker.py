"""Several ucx actors of one process send through one UCX worker of theirs (an endpoint each,
``transport/ucx/actor.py``) to a real learner: every step arrives once, an actor that closes
leaves the others sending, and the last close releases the worker."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from rlink_ucx import Learner, RLinkDataset
from tests.conftest import ucx_importable

SPAWN = mp.get_context("spawn")
ACTORS, FIRST_ID, HALF = 4, 100, 50

pytestmark = pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")


def _actors_sharing_a_worker(address: str, results) -> None:
    """ACTORS ucx actors in this process: each puts HALF steps; the first two close; the others
    put HALF more. Report how many workers they held and whether they shared one."""
    from rlink_ucx import Actor
    from rlink_ucx.transport.ucx import actor as ucx_actor
    actors = [Actor(address, transport="ucx", actor_id=FIRST_ID + i) for i in range(ACTORS)]
    workers = {id(a._conn.sender.worker) for a in actors}  # type: ignore[union-attr]
    held = len(ucx_actor._workers)
    for seq in range(HALF):
        for a in actors:
            a.put({"x": np.int64(a.actor_id * 1000 + seq)})
    for a in actors[:2]:
        a.flush(30)
        a.close()
    held_after_two = len(ucx_actor._workers)
    for seq in range(HALF, 2 * HALF):
        for a in actors[2:]:
            a.put({"x": np.int64(a.actor_id * 1000 + seq)})
    for a in actors[2:]:
        a.flush(30)
        a.close()
    results.put({"workers": len(workers), "held": held, "held_after_two": held_after_two,
                 "held_after_all": len(ucx_actor._workers)})  # fmt: skip


@pytest.mark.timeout(120)
def test_actors_of_one_process_share_one_ucx_worker_and_deliver_every_step_once():
    with Learner("127.0.0.1:0", transport="ucx") as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=_actors_sharing_a_worker, args=(learner.address, results))
        proc.start()
        want = 2 * HALF + 2 * 2 * HALF
        got: dict[int, list[int]] = {}
        for _ in range(want):
            batch = dataset.fetch(timeout=60)
            actor, seq, x = int(batch.actor_id[0]), int(batch.seq[0]), int(batch["x"][0])
            assert x == actor * 1000 + seq, (actor, seq, x)
            got.setdefault(actor, []).append(seq)
        report = results.get(timeout=60)
        proc.join(30)
        assert proc.exitcode == 0
        planes = {a["actor_id"]: a["transport"] for a in learner.stats()["ended_actors"]}
    assert report == {"workers": 1, "held": 1, "held_after_two": 1, "held_after_all": 0}, report
    assert {a: sorted(s) for a, s in got.items()} == {
        FIRST_ID + i: list(range(HALF if i < 2 else 2 * HALF)) for i in range(ACTORS)
    }
    assert set(planes.values()) == {"ucx"}, planes

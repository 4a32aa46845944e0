"""Several threads putting into one Actor: every step arrives exactly once, over real sockets.

Frames are numbered when steps are written and must reach the learner in that order. A full
frame sent from one thread after another thread's later frame had already left broke the
session (the learner refuses a frame out of order) and lost steps; these tests put from four
threads at once, with small frames so that frames fill, leave directly, leave zero-copy or
wait in the I/O thread's queue all the time.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner, RLinkDataset
from tests.conftest import TRANSPORTS

THREADS = 4
PER_THREAD = 12_000


def put_from_threads(actor: Actor, sizes: list[int]) -> list[str]:
    """Each thread puts its own range of ``x`` values in chunks of ``sizes`` (cycled)."""
    errors: list[str] = []

    def run(t: int) -> None:
        try:
            at, i = 0, t
            while at < PER_THREAD:
                n = min(sizes[i % len(sizes)], PER_THREAD - at)
                start = t * PER_THREAD + at
                if n == 1:
                    actor.put({"x": np.int64(start)})
                else:
                    actor.put_many({"x": np.arange(start, start + n, dtype=np.int64)})
                at, i = at + n, i + 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("sizes", [[50], [1, 7, 300, 700, 2, 513]], ids=["chunks", "mixed"])
def test_four_threads_putting_into_one_actor_deliver_every_step_once(transport, sizes):
    total = THREADS * PER_THREAD
    config = Config(frame_bytes=4096, put_timeout=60)  # 512 steps a frame: frames fill all the time
    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=1000)
        with Actor(learner.address, transport=transport, schema={"x": ("int64", ())}, config=config) as actor:
            errors = put_from_threads(actor, sizes)
            actor.flush(timeout=60)
            got = np.concatenate([dataset.fetch(timeout=30)["x"].numpy() for _ in range(total // 1000)])
            stats = actor.stats()
    assert errors == []
    assert np.array_equal(np.sort(got), np.arange(total)), "steps lost or duplicated"
    assert stats["reconnects"] == 0 and stats["steps_lost"] == 0, stats  # the session was never broken
    assert stats["steps_acked"] == total, stats

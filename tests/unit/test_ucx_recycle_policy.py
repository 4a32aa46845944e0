"""When the learner's UCX plane recycles its worker (the live-actor cost against stale memory)."""

import pytest

from rlink_ucx.transport.ucx.learner import recycle_due


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("ended", "live", "after", "due"),
    [
        (15, 3, 16, False),  # a small fleet waits for the floor
        (16, 3, 16, True),
        (16, 200, 16, False),  # a large fleet waits for twice its size: 200 reconnects are not cheap
        (399, 200, 16, False),
        (400, 200, 16, True),
        (3, 1, 3, True),
        (10_000, 0, 0, False),  # 0 switches recycling off
    ],
)
def test_a_worker_is_recycled_after_the_floor_and_twice_the_live_sessions(ended, live, after, due):
    assert recycle_due(ended, live, after) is due

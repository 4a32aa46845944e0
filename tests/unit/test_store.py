"""The receive ring: FIFO, bounded, wrap-around, torn frames never yielded."""

import threading

import pytest

from rlink_ucx import Closed, TimeoutError
from rlink_ucx._codec import Schema
from rlink_ucx._store import StepRing

SCHEMA = Schema.from_spec({"x": ("int64", ())})


def fill(ring, seg, first):
    view = ring.field_views(seg)[0]
    for i in range(seg.n):
        view[i * 8 : (i + 1) * 8] = (first + i).to_bytes(8, "little", signed=True)
    ring.commit(seg)


def values(ring, pieces):
    return [int(ring.views[0][p.start + i]) for p in pieces for i in range(p.count)]


def test_fifo_across_wraparound_and_space_accounting():
    ring = StepRing(SCHEMA, 16 * 8, max_frame_steps=4)
    assert ring.capacity == 16
    seen, nxt = [], 0
    wraps = 0
    for i in range(60):
        if ring.grantable() >= 3:  # the learner's credit rule
            ring.grant(3)
            seg = ring.reserve(3, actor_id=1, seq=nxt, version=0)
            wraps += seg.start == 0
            fill(ring, seg, nxt)
            nxt += 3
        want = min(ring.ready_steps(), 1 + i % 3)
        if want:
            pieces, take = ring.take(want, timeout=1)
            seen += values(ring, pieces)
            ring.release(take)
        assert ring.used <= ring.capacity
    assert wraps > 3
    pieces, take = ring.take(ring.ready_steps(), timeout=1)
    seen += values(ring, pieces)
    assert seen == list(range(nxt))


def test_torn_frame_is_skipped_and_its_space_freed():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=8)
    a = ring.reserve(4, 1, 0, 0)
    b = ring.reserve(4, 2, 0, 0)
    fill(ring, b, 100)
    with pytest.raises(TimeoutError):
        ring.take(4, timeout=0.05)  # a is still pending in front of b
    ring.abandon(a)
    pieces, take = ring.take(4, timeout=1)
    assert values(ring, pieces) == [100, 101, 102, 103]
    assert [p.actor_id for p in pieces] == [2]
    ring.release(take)
    assert ring.used == 0 and ring.stats.torn_frames == 1


def test_grantable_keeps_a_frame_of_slack():
    ring = StepRing(SCHEMA, 32 * 8, max_frame_steps=8)
    assert ring.grantable() == 32 - 8
    ring.grant(20)
    assert ring.grantable() == 4


def test_close_wakes_a_waiting_consumer():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=8)
    errors = []

    def consumer():
        try:
            ring.take(1, timeout=10)
        except Closed as exc:
            errors.append(exc)

    t = threading.Thread(target=consumer)
    t.start()
    ring.close()
    t.join(2)
    assert not t.is_alive() and len(errors) == 1

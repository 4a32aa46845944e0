"""No head-of-line blocking in the receive ring: steps of complete frames are handed out whatever
frame is still arriving, a frame still arriving holds only its own steps (others cycle the ring
around it), a torn frame's space comes back at once, and each actor's steps stay in order."""

from __future__ import annotations

import itertools
import random
import threading
import time

import numpy as np
import pytest

from rlink_ucx import ProtocolError, TimeoutError
from rlink_ucx.store import ready as ready_module
from rlink_ucx.store.extents import FreeExtents
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import Schema
from tests.unit.test_land import _frame, _session

pytestmark = pytest.mark.timeout(60)

SCHEMA = Schema.from_spec({"x": ("int64", ())})


def fill(ring: StepRing, seg, first: int) -> None:
    data = np.arange(first, first + seg.n, dtype=np.int64).view(np.uint8)
    offset = 0
    for view in ring.field_views(seg)[0]:
        view[:] = data[offset : offset + len(view)]
        offset += len(view)
    ring.commit(seg)


def take_values(ring: StepRing, count: int) -> list[tuple[int, int, int]]:
    """The next ``count`` steps as (actor, seq, value), released at once."""
    pieces, take = ring.take(count, timeout=1)
    assert all(p.start // ring.chunk_steps == (p.start + p.count - 1) // ring.chunk_steps for p in pieces)
    out = []
    for p in pieces:
        vals = ring.piece_bytes(0, p).view(np.int64)
        out += [(p.actor_id, p.seq + i, int(v)) for i, v in enumerate(vals)]
    ring.release(take)
    return out


def test_steps_of_a_complete_frame_are_handed_out_past_one_still_arriving():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=8, chunk_steps=8)
    slow = ring.reserve(4, actor_id=1, seq=0, version=0)
    fast = ring.reserve(4, actor_id=2, seq=0, version=0)
    fill(ring, fast, 200)
    assert take_values(ring, 4) == [(2, i, 200 + i) for i in range(4)]
    assert ring.used == 4  # the fast frame's space is free again; the slow one holds its 4
    fill(ring, slow, 100)
    assert take_values(ring, 4) == [(1, i, 100 + i) for i in range(4)]
    assert ring.used == 0


def test_frames_completed_out_of_order_are_taken_in_ring_order_and_a_whole_chunk_is_lent():
    # Four actors' frames arrive interleaved (as a pump reads four connections): once all are
    # complete, the batch is their ring positions in order, one whole chunk, lent without a copy.
    ring = StepRing(SCHEMA, 8 * 8 * 4, max_frame_steps=2, chunk_steps=8)
    segs = [ring.reserve(2, actor_id=a, seq=0, version=0) for a in range(4)]
    for a in (1, 0, 3, 2):
        fill(ring, segs[a], 100 * a)
    pieces, take = ring.take(8, timeout=1)
    assert [(p.actor_id, p.start, p.count) for p in pieces] == [(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 2)]
    lent = ring.lend_chunk(pieces)
    assert lent is not None and lent[0].view(np.int64).tolist() == [0, 1, 100, 101, 200, 201, 300, 301]
    ring.release(take)


def test_a_take_waits_for_a_frame_that_just_began_ahead_of_it_but_not_for_one_arriving_for_long(monkeypatch):
    monkeypatch.setattr(ready_module, "IN_ORDER_GRACE", 5.0)  # long, so that the test does not race the clock
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=2, chunk_steps=4)
    first = ring.reserve(2, actor_id=1, seq=0, version=0)
    second = ring.reserve(2, actor_id=2, seq=0, version=0)
    fill(ring, second, 200)
    threading.Timer(0.05, fill, (ring, first, 100)).start()
    started = time.monotonic()
    assert take_values(ring, 2) == [(1, 0, 100), (1, 1, 101)]  # waited for the young frame ahead
    assert 0.04 < time.monotonic() - started < 4.0
    assert take_values(ring, 2) == [(2, 0, 200), (2, 1, 201)]
    # A frame arriving for longer than the grace is passed at once (a slow link, a trickler).
    slow = ring.reserve(2, actor_id=3, seq=0, version=0)
    fast = ring.reserve(2, actor_id=4, seq=0, version=0)
    slow.placed_at -= 10.0
    fill(ring, fast, 400)
    started = time.monotonic()
    assert take_values(ring, 2) == [(4, 0, 400), (4, 1, 401)]
    assert time.monotonic() - started < 1.0


def test_others_cycle_the_ring_many_times_around_a_held_frame_and_wrap_in_pieces():
    ring = StepRing(SCHEMA, 16 * 8, max_frame_steps=3, chunk_steps=4)
    assert ring.capacity == 16
    held = ring.reserve(3, actor_id=9, seq=0, version=0)  # a trickler's frame, never finished here
    ring.grant(0)
    nxt, seen, split = 0, [], 0
    for _ in range(60):  # 60 frames of 3 through 13 free steps: 11 laps around the held frame
        assert ring.grantable() == ring.capacity - 3
        ring.grant(3)
        seg = ring.reserve(3, actor_id=1, seq=nxt, version=0)
        split += seg.runs is not None
        assert not any(held.start <= s < held.start + 3 for s, k in seg.places() for s in range(s, s + k))
        fill(ring, seg, 1000 + nxt)
        nxt += 3
        seen += take_values(ring, 3)
        assert ring.used == 3  # only the held frame
    assert seen == [(1, i, 1000 + i) for i in range(nxt)]
    assert split > 3, "frames should have been laid around the held frame (and the ring's end) in pieces"
    fill(ring, held, 7)
    assert take_values(ring, 3) == [(9, 0, 7), (9, 1, 8), (9, 2, 9)]
    assert ring.used == 0 and ring.stats.peak_used == 6


def test_a_sender_holds_at_most_the_frame_it_sends_and_the_rest_is_granted_to_others():
    ring = StepRing(SCHEMA, 32 * 8, max_frame_steps=8, chunk_steps=8)
    with pytest.raises(ProtocolError, match="limit is 8"):
        ring.reserve(9, actor_id=1, seq=0, version=0)  # one frame is capped whatever the credit
    ring.grant(8)
    slow = ring.reserve(8, actor_id=1, seq=0, version=0)
    assert ring.grantable() == ring.capacity - 8
    ring.grant(ring.capacity - 8)  # the rest to others: all of it can be reserved around the slow frame
    others = [ring.reserve(8, actor_id=2, seq=8 * i, version=0) for i in range(3)]
    assert ring.grantable() == 0 and ring.used == ring.capacity
    with pytest.raises(ProtocolError, match="exceeds the credit"):
        ring.reserve(1, actor_id=3, seq=0, version=0)
    for i, seg in enumerate(others):
        fill(ring, seg, 8 * i)
    assert [v for _, _, v in take_values(ring, 24)] == list(range(24))
    ring.abandon(slow)
    assert ring.used == 0 and ring.stats.torn_frames == 1


def test_each_actor_stays_in_order_when_frames_of_many_complete_out_of_order():
    rng = random.Random(5)
    ring = StepRing(SCHEMA, 40 * 8, max_frame_steps=4, chunk_steps=4)
    next_seq = dict.fromkeys(range(5), 0)
    open_frames: dict[int, object] = {}  # actor -> its frame still arriving (one at a time, as on a connection)
    got: dict[int, list[int]] = {a: [] for a in range(5)}
    for _ in range(2000):
        actor = rng.randrange(5)
        if actor in open_frames and rng.random() < 0.5:
            seg = open_frames.pop(actor)
            fill(ring, seg, seg.seq)  # the value is the step's seq
        elif actor not in open_frames:
            n = rng.randint(1, 4)
            if ring.grantable() >= n:
                ring.grant(n)
                open_frames[actor] = ring.reserve(n, actor_id=actor, seq=next_seq[actor], version=0)
                next_seq[actor] += n
        ready = ring.ready_steps()
        if ready and rng.random() < 0.4:
            for a, seq, value in take_values(ring, rng.randint(1, ready)):
                assert seq == value
                got[a].append(seq)
    for seg in open_frames.values():
        fill(ring, seg, seg.seq)
    for a, seq, _ in take_values(ring, ring.ready_steps()):
        got[a].append(seq)
    assert all(got[a] == list(range(next_seq[a])) for a in got), "an actor's steps came out of order or twice"
    assert ring.used == 0


def test_a_session_s_unfinished_frame_is_torn_when_it_ends_and_frees_its_space_at_once():
    session, ring = _session(credit=4)
    header, payload = _frame(0, 4)
    views = session.begin(header)
    views[0][:8] = payload[:8]  # a few bytes came; the rest never will
    other, _ = _session(credit=4)
    other.ring = ring
    other.actor_id = 8  # another actor on the same ring
    ring.grant(4)
    other.land(*map(memoryview, _frame(0, 4, actor_id=8)))
    assert ring.ready_steps() == 4 and ring.used == 8
    session.close("test: the actor went away", lost=True)
    session.abandon()  # what its receiver does once nothing more can be written
    assert ring.used == 4 and ring.stats.torn_frames == 1 and session.stats.torn_frames == 1
    pieces, take = ring.take(4, timeout=1)
    assert {p.actor_id for p in pieces} == {8} and sum(p.count for p in pieces) == 4
    ring.release(take)
    with pytest.raises(TimeoutError):
        ring.take(1, timeout=0.05)  # the torn frame is never handed out
    assert ring.used == 0


def test_free_extents_match_a_set_of_free_positions():
    rng = random.Random(3)
    ext = FreeExtents(50)
    free, held, cursor = set(range(50)), [], 0
    for _ in range(3000):
        if held and (rng.random() < 0.5 or ext.free < 5):
            runs = held.pop(rng.randrange(len(held)))
            for s, k in runs:
                ext.give(s, k)
                free |= set(range(s, s + k))
        else:
            n = rng.randint(1, min(5, ext.free))
            runs = ext.take(n, cursor)
            taken = [p for s, k in runs for p in range(s, s + k)]
            assert len(taken) == n and set(taken) <= free
            free -= set(taken)
            held.append(runs)
            cursor = (runs[-1][0] + runs[-1][1]) % 50
        extents = ext.extents()
        assert {p for s, e in extents for p in range(s, e)} == free and ext.free == len(free)
        assert all(e < s2 for (_, e), (s2, _) in itertools.pairwise(extents)), "extents must be sorted and joined"


def test_torn_frames_behind_a_frame_nobody_takes_yet_are_forgotten():
    # No fetch yet, and an actor whose every frame is torn: the ring's record of placed frames
    # must not keep one entry per torn frame.
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=2, chunk_steps=4)
    fill(ring, ring.reserve(2, actor_id=1, seq=0, version=0), 0)  # complete, not taken
    for i in range(10_000):
        ring.abandon(ring.reserve(2, actor_id=2, seq=2 * i, version=0))
    assert len(ring.frames._placed) <= 2048
    assert ring.used == 2 and ring.stats.torn_frames == 10_000
    assert take_values(ring, 2) == [(1, 0, 0), (1, 1, 1)]

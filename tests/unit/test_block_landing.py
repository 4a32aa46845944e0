"""A pump's burst landed in blocks (``burst._land_blocks``, ``StepRing.land_block``,
``store/block.py``): headers checked as arrays, the frames that pass landed side by side with
one copy per field. A burst of one frame from each of many sessions, good and bad mixed, ends
only the bad sessions with the same errors as the one-by-one path, and lands every good frame
exactly once, with its own bytes; the same bursts give the same result on both paths."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlink_ucx import Closed, ProtocolError
from rlink_ucx.session.learner import burst
from rlink_ucx.session.learner.burst import land_burst
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import Schema
from rlink_ucx.wire.frame import FRAME_HEADER
from rlink_ucx.wire.messages import PROTOCOL_VERSION
from tests.unit.test_burst_landing import STEP, _frame, _landed, _payload, _sessions

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def blocks(monkeypatch):
    """Counts the frames each ``StepRing.land_block`` call landed (the block path was taken)."""
    landed: list[int] = []
    real = StepRing.land_block

    def counting(self, n_steps, actor_ids, *args):
        ok = real(self, n_steps, actor_ids, *args)
        if ok:
            landed.append(len(actor_ids))
        return ok

    monkeypatch.setattr(StepRing, "land_block", counting)
    return landed


def _views(sessions, burst_frames):
    return [(sessions[s], memoryview(h), memoryview(p)) for s, h, p in burst_frames]


def test_a_burst_of_many_sessions_lands_in_one_block_with_every_frame_s_own_bytes(blocks):
    actors = list(range(1, 41))
    sessions, ring = _sessions(actors)
    frames = [(a, *_frame(a, 0)) for a in actors]
    assert land_burst(_views(sessions, frames)) == []
    assert blocks == [40]
    assert _landed(ring) == collections.Counter((a, 0) for a in actors)
    assert ring.stats.frames_in == 40 and ring.stats.bytes_in == 40 * STEP
    for s in sessions.values():
        assert (s.next_seq, s.flow.credit, s.stats.frames, s.stats.steps, s.stats.bytes) == (1, 999, 1, 1, STEP)


def test_a_mixed_burst_ends_only_the_bad_sessions_with_the_one_by_one_errors(blocks):
    actors = list(range(1, 31))
    sessions, ring = _sessions(actors)
    sessions[12].next_seq = 5  # expects seq 5: its frame at 0..0 is a resend, dropped and counted
    sessions[13].resumed, sessions[13].next_seq = True, 2  # a resumed stream: the one-by-one path
    bad = {
        3: _frame(3, 0, payload_bytes=3 * STEP),  # announces three steps' bytes for one
        5: _frame(5, 4),  # expected seq 0
        7: _frame(7, 0, actor_id=9, incarnation=9),  # another session's actor
        9: _frame(9, 0, schema_id=2),  # a schema it never negotiated
        11: _frame(11, 0, n_steps=5, payload_bytes=5 * STEP),  # over the ring's 4 steps a frame
    }
    frames = []
    for a in actors:
        header, payload = bad.get(a) or _frame(a, 0)
        if a == 15:
            payload = payload[: STEP - 3]  # truncated: fewer bytes than announced
        if a == 13:
            header, payload = _frame(13, 4)  # resumed past where it stopped: 2 steps lost, counted
        frames.append((a, header, payload))
    failed = {s.actor_id: exc for s, exc in land_burst(_views(sessions, frames))}
    assert set(failed) == {3, 5, 7, 9, 11, 15}
    assert all(isinstance(exc, ProtocolError) for exc in failed.values())
    assert "seq 4, expected 0" in str(failed[5]) and "claims actor 9/9" in str(failed[7])
    assert "schema id 2" in str(failed[9]) and "5 steps" in str(failed[11]) and "came with" in str(failed[15])
    good = [a for a in actors if a not in failed and a != 12]
    assert blocks == [len(good) - 1]  # all but the resumed stream's first frame, in one block
    expected = collections.Counter((a, 0) for a in good if a != 13)
    expected[(13, 4)] = 1
    assert _landed(ring) == expected
    assert sessions[12].stats.duplicate_steps == 1 and sessions[12].next_seq == 5
    assert sessions[13].stats.lost_steps == 2 and sessions[13].next_seq == 5
    assert all(sessions[a].next_seq == 0 and sessions[a].flow.credit == 1000 for a in failed)


def test_several_frames_of_a_session_land_in_one_block_in_their_order(blocks):
    actors = list(range(1, 11))
    sessions, ring = _sessions(actors)
    frames = [(a, *_frame(a, seq)) for seq in range(3) for a in actors]  # sessions interleaved
    frames += [(5, *_frame(5, 3, 2))]  # actor 5: a frame of two steps after three of one: one by one
    bad = _frame(7, 3, actor_id=8, incarnation=8)
    frames += [(7, *bad)]  # actor 7's fourth frame is another actor's: its first three land alone
    failed = {s.actor_id: exc for s, exc in land_burst(_views(sessions, frames))}
    assert set(failed) == {7} and "claims actor 8/8" in str(failed[7])
    assert blocks == [24]
    expected = collections.Counter((a, seq) for a in actors for seq in range(3))
    expected.update([(5, 3), (5, 4)])
    assert _landed(ring) == expected
    assert [sessions[a].next_seq for a in actors] == [3, 3, 3, 3, 5, 3, 3, 3, 3, 3]
    assert sessions[1].flow.credit == 997 and sessions[1].stats.frames == 3


def test_frames_of_several_steps_straddle_chunks_and_land_by_number_of_steps(blocks):
    actors = list(range(1, 25))
    sessions, ring = _sessions(actors)
    sizes = {a: 3 if a % 2 else 2 for a in actors}  # 3-step frames straddle the ring's 8-step chunks
    frames = [(a, *_frame(a, 0, sizes[a])) for a in actors]
    assert land_burst(_views(sessions, frames)) == []
    assert sorted(blocks) == [12, 12]
    assert _landed(ring) == collections.Counter((a, s) for a in actors for s in range(sizes[a]))


def test_a_burst_lands_one_by_one_where_the_free_space_is_not_one_run(blocks):
    actors = list(range(1, 13))
    sessions, ring = _sessions(actors)
    ring.land(2, 99, 0, 0, 0.0, memoryview(_payload(99, 0, 2)))  # positions 0-1
    arriving = ring.reserve(2, 98, 0, 0)  # 2-3: still arriving
    _, take = ring.take(2, 1.0)
    ring.release(take)  # 0-1 free again, behind the cursor
    ring._space.head = ring.capacity - 4  # the free run at the cursor is 4 steps long
    frames = [(a, *_frame(a, 0)) for a in actors]
    assert land_burst(_views(sessions, frames)) == []
    assert blocks == []
    ring.abandon(arriving)
    assert _landed(ring) == collections.Counter((a, 0) for a in actors)


def test_a_block_into_a_closed_ring_ends_its_sessions_with_closed():
    actors = list(range(1, 11))
    sessions, ring = _sessions(actors)
    ring.close()
    failed = land_burst(_views(sessions, [(a, *_frame(a, 0)) for a in actors]))
    assert {s.actor_id for s, _ in failed} == set(actors)
    assert all(isinstance(exc, Closed) for _, exc in failed)


def test_frames_older_than_the_ring_s_min_version_are_dropped_and_their_space_freed():
    actors = list(range(1, 11))
    sessions, ring = _sessions(actors)
    ring.min_version = 3
    frames = [(a, *_frame(a, 0, version=2 if a <= 4 else 3)) for a in actors]
    assert land_burst(_views(sessions, frames)) == []
    assert ring.stats.stale_dropped == 4 and ring.used == 6
    assert _landed(ring) == collections.Counter((a, 0) for a in actors if a > 4)


# --- the same bursts through both paths ------------------------------------------------------
def _hostile(rng: random.Random, actor: int, seq: int) -> tuple[bytes, bytes]:
    """A frame for session ``actor`` expecting ``seq``: good, or one field off its limits."""
    n = rng.choice([1, 1, 2, 4])
    fields = [b"RLNK", PROTOCOL_VERSION, 0, 1, n, actor, actor, seq, 0, n * STEP, 0]
    if rng.random() < 0.4:
        i = rng.randrange(len(fields))
        fields[i] = rng.choice({0: [b"RLNX"], 1: [0, 0xFFFF], 3: [0, 2, 2**32 - 1], 4: [0, 5, 2**32 - 1],
                                5: [actor + 1, 2**64 - 1], 6: [0, 2**64 - 1], 7: [seq + 1, 2**63 - 1, 2**64 - 1],
                                9: [0, STEP, 2**63, 2**64 - 1]}.get(i, [fields[i]]))  # fmt: skip
    payload = _payload(actor, seq, n)
    cut = rng.random()
    payload = payload[: rng.randrange(len(payload))] if cut < 0.1 else payload + b"x" if cut < 0.15 else payload
    return FRAME_HEADER.pack(*fields), payload


def _outcome(rng_seed: int, block_min: int) -> tuple[object, ...]:
    rng = random.Random(rng_seed)
    actors = list(range(1, 25))
    sessions, ring = _sessions(actors)
    seqs = {a: rng.choice([0, 0, 3]) for a in actors}
    for a, s in seqs.items():
        sessions[a].next_seq = s
    queues: dict[int, list[tuple[int, bytes, bytes]]] = {}
    for a in actors:  # a few frames from some sessions, each after the one before (if that one was good)
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            header, payload = _hostile(rng, a, seqs[a])
            queues.setdefault(a, []).append((a, header, payload))
            seqs[a] += FRAME_HEADER.unpack(header)[4] % 8
    frames = []
    while queues:  # sessions interleaved at random, each session's frames in their order
        a = rng.choice(sorted(queues))
        frames.append(queues[a].pop(0))
        if not queues[a]:
            del queues[a]
    saved, burst.BLOCK_MIN = burst.BLOCK_MIN, block_min
    try:
        failed = {s.actor_id: type(exc).__name__ + str(exc) for s, exc in land_burst(_views(sessions, frames))}
    finally:
        burst.BLOCK_MIN = saved
    state = {a: (s.next_seq, s.flow.credit, s.stats.frames, s.stats.steps, s.stats.bytes, s.stats.duplicate_steps)
             for a, s in sessions.items()}  # fmt: skip
    return failed, _landed(ring), state, ring.used


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_hostile_bursts_give_the_same_outcome_in_blocks_as_one_by_one(seed):
    blocks = _outcome(seed, burst.BLOCK_MIN)
    each = _outcome(seed, 10**9)
    assert blocks == each
    _, landed, _, _ = blocks
    assert all(count == 1 for count in landed.values())

"""The receive ring: FIFO, bounded, wrap-around, torn frames never yielded, chunks lent."""

import threading

import numpy as np
import pytest

from rlink_ucx import Closed, TimeoutError
from rlink_ucx.store.gather import BatchAssembler
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import Schema

SCHEMA = Schema.from_spec({"x": ("int64", ())})


def fill(ring, seg, first):
    data = np.arange(first, first + seg.n, dtype=np.int64).view(np.uint8)
    offset = 0
    for view in ring.field_views(seg)[0]:
        view[:] = data[offset : offset + len(view)]
        offset += len(view)
    ring.commit(seg)


def values(ring, pieces):
    return [int(x) for p in pieces for x in ring.piece_bytes(0, p).view(np.int64)]


def test_fifo_across_wraparound_and_chunks():
    ring = StepRing(SCHEMA, 16 * 8, max_frame_steps=3, chunk_steps=4)
    assert ring.capacity == 16 and len(ring.chunks) == 4
    seen, nxt, wraps = [], 0, 0
    for i in range(80):
        if ring.grantable() >= 3:  # the learner's credit rule
            ring.grant(3)
            seg = ring.reserve(3, actor_id=1, seq=nxt, version=0)
            wraps += seg.start + seg.n > ring.capacity
            fill(ring, seg, nxt)
            nxt += 3
        want = min(ring.ready_steps(), 1 + i % 3)
        if want:
            pieces, take = ring.take(want, timeout=1)
            assert all(p.start // 4 == (p.start + p.count - 1) // 4 for p in pieces), "a piece crossed a chunk"
            assert [p.seq for p in pieces] == sorted(p.seq for p in pieces)
            seen += values(ring, pieces)
            ring.release(take)
        assert ring.used <= ring.capacity
    assert wraps > 3, "frames should have wrapped around the end of the ring"
    pieces, take = ring.take(ring.ready_steps(), timeout=1)
    seen += values(ring, pieces)
    assert seen == list(range(nxt))


def test_torn_frame_is_skipped_and_its_space_freed():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=8)
    a = ring.reserve(4, 1, 0, 0)
    b = ring.reserve(4, 2, 0, 0)
    fill(ring, b, 100)
    with pytest.raises(TimeoutError):
        ring.take(5, timeout=0.05)  # only b's 4 steps are ready: a is still arriving
    ring.abandon(a)
    assert ring.used == 4  # a's space came back at once, though it was in front of b
    pieces, take = ring.take(4, timeout=1)
    assert values(ring, pieces) == [100, 101, 102, 103]
    assert [p.actor_id for p in pieces] == [2]
    ring.release(take)
    assert ring.used == 0 and ring.stats.torn_frames == 1
    assert ring.stats.peak_used == 8  # both frames were held at once


def test_grantable_is_what_is_left():
    ring = StepRing(SCHEMA, 32 * 8, max_frame_steps=8, chunk_steps=8)
    assert ring.grantable() == ring.capacity == 32
    ring.grant(20)
    assert ring.grantable() == 12


def test_aligned_batches_are_lent_and_a_kept_batch_is_never_overwritten():
    ring = StepRing(SCHEMA, 16 * 8, max_frame_steps=4, chunk_steps=4)
    assembler = BatchAssembler(ring, 4, "cpu")
    kept, nxt = [], 0
    for _ in range(12):  # three passes over the ring's 4 chunks
        ring.grant(4)
        fill(ring, ring.reserve(4, 1, nxt, 0), nxt)
        nxt += 4
        pieces, take = ring.take(4, timeout=1)
        kept.append(assembler.assemble(pieces, take, 0))
    assert assembler.lent_batches == 12
    assert [b["x"].tolist() for b in kept] == [list(range(i, i + 4)) for i in range(0, 48, 4)]
    assert [b.seq.tolist() for b in kept][-1] == [44, 45, 46, 47]


def test_misaligned_batches_are_copied():
    ring = StepRing(SCHEMA, 16 * 8, max_frame_steps=3, chunk_steps=4)
    assembler = BatchAssembler(ring, 4, "cpu")
    ring.grant(6)
    fill(ring, ring.reserve(3, 1, 0, 0), 0)
    fill(ring, ring.reserve(3, 1, 3, 0), 3)
    pieces, take = ring.take(2, timeout=1)  # leaves the front unaligned
    ring.release(take)
    pieces, take = ring.take(4, timeout=1)
    batch = assembler.assemble(pieces, take, 0)
    assert batch["x"].tolist() == [2, 3, 4, 5] and assembler.lent_batches == 0


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


def test_stale_frames_are_dropped_counted_and_their_space_freed():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=4, chunk_steps=4)
    for i, version in enumerate([1, 2, 3, 1, 3]):
        ring.grant(4)
        fill(ring, ring.reserve(4, 1, 4 * i, version), 4 * i)
    first, take = ring.take(2, timeout=1)  # half of the version-1 frame, before any limit
    assert values(ring, first) == [0, 1]
    pieces, take2 = ring.take(8, timeout=1, min_version=3)
    assert values(ring, pieces) == [8, 9, 10, 11, 16, 17, 18, 19]
    assert {p.version for p in pieces} == {3}
    assert ring.stats.stale_dropped == 2 + 4 + 4
    ring.release(take2)
    assert ring.used == 0, "dropped and released steps must give their space back"
    ring.grant(4)
    late = ring.reserve(4, 1, 20, 2)  # stale on arrival: dropped at commit, never waited for
    fill(ring, late, 20)
    assert ring.stats.stale_dropped == 14 and ring.used == 0
    with pytest.raises(TimeoutError):
        ring.take(1, timeout=0.05, min_version=3)


def test_random_interleaving_of_frames_takes_and_kept_batches_stays_fifo_and_intact():
    rng = np.random.default_rng(0)
    ring = StepRing(SCHEMA, 32 * 8, max_frame_steps=4, chunk_steps=4)
    assembler = BatchAssembler(ring, 4, "cpu")
    kept: list = []
    nxt = taken = 0
    for _ in range(400):
        while ring.grantable() >= 4 and rng.random() < 0.7:
            n = int(rng.integers(1, 5))
            ring.grant(n)
            fill(ring, ring.reserve(n, 1, nxt, 0), nxt)
            nxt += n
        if ring.ready_steps() >= 4:
            pieces, take = ring.take(4, timeout=1)
            batch = assembler.assemble(pieces, take, 0)
            assert batch["x"].tolist() == list(range(taken, taken + 4))
            taken += 4
            if rng.random() < 0.3:
                kept.append(batch)  # held on to by the caller for a while
            if len(kept) > 5:
                kept.pop(int(rng.integers(0, len(kept))))
        for b in kept:
            first = b.seq[0].item()
            assert b["x"].tolist() == list(range(first, first + 4)), "a kept batch was overwritten"
    assert assembler.lent_batches > 20 and taken > 200


@pytest.mark.parametrize("pieces", [3, 8, 9, 40])  # the loop over pieces, its limit, the vectorized path
def test_batch_metadata_names_each_steps_actor_seq_version_and_staleness(pieces):
    from rlink_ucx.store.ring import Piece

    rng = np.random.default_rng(pieces)
    counts = rng.integers(1, 9, pieces)
    batch_size = int(counts.sum()) + 5  # a short last batch: rows past the steps are not read
    assembler = BatchAssembler(StepRing(SCHEMA, 64 * 8, max_frame_steps=8, chunk_steps=8), batch_size, "cpu")
    expected, parts = [], []
    for i, n in enumerate(counts.tolist()):
        actor, seq, version = int(rng.integers(0, 5)), int(rng.integers(0, 10**9)), int(rng.integers(0, 7))
        parts.append(Piece(0, n, actor, seq, version))
        expected += [(version, actor, seq + k, 9 - version) for k in range(n)]
    meta = assembler._meta(parts, learner_version=9)
    assert [tuple(int(v) for v in meta[:, i]) for i in range(len(expected))] == expected


def test_adjacent_pieces_are_copied_as_one_but_never_across_a_chunk_or_a_gap():
    from rlink_ucx.store.gather import joined
    from rlink_ucx.store.ring import Piece

    pieces = [Piece(2, 3, 1, 10, 0), Piece(5, 1, 2, 40, 0), Piece(6, 2, 1, 13, 0),  # side by side
              Piece(8, 4, 3, 7, 0),  # starts chunk 1 (chunks of 8 steps)
              Piece(13, 2, 1, 15, 0)]  # after a gap  # fmt: skip
    assert [(p.start, p.count) for p in joined(pieces, 8)] == [(2, 6), (8, 4), (13, 2)]
    assert joined([], 8) == []


def test_a_batch_of_many_small_frames_from_several_actors_is_copied_intact():
    ring = StepRing(SCHEMA, 256 * 8, max_frame_steps=8, chunk_steps=64)
    assembler = BatchAssembler(ring, 48, "cpu")  # not a chunk: always copied
    nxt = 0
    for n in [3, 5, 1, 8, 2, 7, 4, 6, 8, 4] * 2:  # 96 steps, frames of "actors" 0-3 in turn
        ring.grant(n)
        fill(ring, ring.reserve(n, nxt % 4, nxt, 0), nxt)
        nxt += n
    for first in (0, 48):  # the second batch crosses from chunk 0 into chunk 1
        pieces, take = ring.take(48, timeout=1)
        batch = assembler.assemble(pieces, take, 0)
        assert batch["x"].tolist() == list(range(first, first + 48))
        assert batch.seq.tolist() == list(range(first, first + 48))


class _CopyEvent:
    """Stands in for a CUDA event: ``synchronize`` blocks until the copy is marked done."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self):
        assert self.done.wait(10)


def test_ring_space_of_a_device_copy_is_released_when_the_copy_completes_not_at_the_next_fetch():
    import queue

    from rlink_ucx.store.gather import _release_when_copied

    ring = StepRing(SCHEMA, 16 * 8, max_frame_steps=4)
    freed = threading.Event()
    ring.on_space_freed = freed.set
    for first in (0, 4):
        seg = ring.reserve(4, actor_id=1, seq=first, version=0)
        fill(ring, seg, first)
    copies: queue.SimpleQueue = queue.SimpleQueue()
    releaser = threading.Thread(target=_release_when_copied, args=(copies, ring), daemon=True)
    releaser.start()
    events = []
    for _ in range(2):
        _pieces, take = ring.take(4, timeout=1)
        events.append(_CopyEvent())
        copies.put((events[-1], take))
    assert not freed.wait(0.2) and ring.used == 8  # copies still running: nothing reusable
    events[0].done.set()
    assert freed.wait(5)  # no fetch in between: the copy's completion alone frees it
    assert ring.used == 4  # only the first take's steps
    events[1].done.set()
    copies.put(None)
    releaser.join(5)
    assert not releaser.is_alive() and ring.used == 0

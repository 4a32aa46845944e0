"""Host tables that take whole ring chunks without copying them (``BlockTable``).

The reference is a copying table fed the same frames with the same seed: the samplers see the
same ids, so batches must be identical. Rings here are small (64 steps, chunks of 16) so that
the table's blocks go round the ring many times.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlink_ucx import ReplayDataset
from rlink_ucx.store.replay import core as replay_core
from rlink_ucx.store.replay.block_table import BlockTable, _forget_unlent
from rlink_ucx.store.ring import StepRing
from rlink_ucx.store.replay.table import ReplayTable
from tests.unit.replay_helpers import PRIO_SCHEMA, SCHEMA, FakeLearner, feed, new_ring, steps, stream, wait_for

FRAMES = [8, 3, 8, 5, 8, 8, 1, 8, 8, 8, 2]  # sizes that do and do not fill chunks of 16


@pytest.fixture(autouse=True)
def adopting(monkeypatch):
    monkeypatch.setattr(replay_core, "ADOPT_MIN_BYTES", 0)  # small test steps still take chunks whole


def small_ring(schema=SCHEMA) -> StepRing:
    return StepRing(schema, 64 * schema.step_bytes, 8, chunk_steps=16)


def feed_both(rings: list[StepRing], total: int, priority: bool = False) -> None:
    """The same frames into each ring: two actors, frame sizes of FRAMES, a torn frame."""
    seqs = {1: 0, 2: 0}
    done, i = 0, 0
    while done < total:
        actor = 1 + (i // 3) % 2
        k = min(FRAMES[i % len(FRAMES)], total - done)
        for ring in rings:
            if priority:
                values = steps(actor, seqs[actor], k, np.full(k, 0.5 + (seqs[actor] % 7), np.float32))
                while ring.grantable() < k:
                    pass
                feed(ring, actor, seqs[actor], values)
            else:
                stream(ring, actor, seqs[actor], k, frame=8)
            if i == 5:  # a frame whose sender vanished: never inserted
                ring.grant(4)
                ring.abandon(ring.reserve(4, 9, 0, 0))
        seqs[actor] += k
        done += k
        i += 1


def pair(total: int, schema=SCHEMA, **kw) -> tuple[ReplayDataset, ReplayDataset]:
    rings = [small_ring(schema), new_ring(schema)]  # the second is too large next to the table to lend blocks
    replays = [ReplayDataset(FakeLearner(ring), seed=5, **kw) for ring in rings]
    feed_both(rings, total, priority=schema is PRIO_SCHEMA)
    for r in replays:
        assert wait_for(lambda r=r: r.inserted == total)
    assert isinstance(replays[0]._core.table, BlockTable) and type(replays[1]._core.table) is ReplayTable
    return replays[0], replays[1]


def held_rows(r: ReplayDataset) -> list[np.ndarray]:
    t = r._core.table
    ids = np.arange(t.first, t.inserted)
    outs = [np.empty((ids.size, f.step_bytes), dtype=np.uint8) for f in t.schema.fields]
    t.gather(ids, outs)
    return outs


def same(a, b) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for attr in ("index", "weight", "version", "actor_id", "seq"):
        assert torch.equal(getattr(a, attr), getattr(b, attr)), attr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sampler,T", [("uniform", None), ("prioritized", None), ("uniform", 3)])
def test_batches_equal_a_copying_tables(sampler, T):
    blocks, copying = pair(1000, capacity=300, batch_size=16, sampler=sampler, sequence_length=T)
    with blocks, copying:
        t = blocks._core.table
        assert t.adopted > 0 and t.copied > 0, (t.adopted, t.copied)  # both paths ran
        for got, want in zip(held_rows(blocks), held_rows(copying)):
            np.testing.assert_array_equal(got, want)
        for _ in range(30):
            a, b = blocks.sample(5), copying.sample(5)
            same(a, b)
            actor, seq = a.actor_id.numpy(), a.seq.numpy()
            np.testing.assert_array_equal(a["action"].numpy(), actor * 1_000_000 + seq)


@pytest.mark.timeout(60)
def test_block_bookkeeping_stays_consistent():
    blocks, copying = pair(1500, capacity=256, batch_size=8)
    with blocks, copying:
        t = blocks._core.table
        m = t.map
        slots = t.slots(np.arange(t.first, t.inserted))
        rows = m.phys[slots]
        assert np.unique(rows).size == rows.size  # no two steps share a row
        held_blocks = rows // t.block
        np.testing.assert_array_equal(m.used, np.bincount(held_blocks, minlength=m.blocks))
        assert not set(held_blocks.tolist()) & m.lent  # the ring never receives into held rows
        assert all(m.used[b] == 0 for b in m.free) and not set(m.free) & m.lent
        ring = blocks.learner.ring
        in_ring = {t.owned_block([c[i] for i in range(len(c))]) for c in ring.chunks} - {None}
        assert in_ring == m.lent and len(in_ring) == ring.capacity // ring.chunk_steps


@pytest.mark.timeout(60)
def test_priorities_sent_with_steps_survive_taking_chunks_whole():
    blocks, copying = pair(600, schema=PRIO_SCHEMA, capacity=300, batch_size=16, sampler="prioritized")
    with blocks, copying:
        assert blocks._core.table.adopted > 0
        np.testing.assert_array_equal(blocks._core.sampler.leaves(), copying._core.sampler.leaves())
        assert "_priority" not in blocks.sample(5)


@pytest.mark.timeout(60)
def test_checkpoint_round_trip_and_taking_chunks_after_a_load(tmp_path):
    blocks, copying = pair(700, capacity=300, batch_size=16, sampler="prioritized")
    with copying:
        blocks.close()  # as the docs say: close, save, load on the same learner
        blocks.save(tmp_path / "c")
        before = held_rows(blocks)
        with ReplayDataset.load(tmp_path / "c", blocks.learner, seed=5) as q:
            t = q._core.table
            assert isinstance(t, BlockTable) and len(q) == 300 and q.inserted == 700
            for got, want in zip(held_rows(q), before):
                np.testing.assert_array_equal(got, want)
            stream(blocks.learner.ring, 3, 0, 400, frame=8)  # new steps, some into blocks of the old table
            assert wait_for(lambda: q.inserted == 1100)
            assert t.adopted > 0
            ids = np.arange(t.first, t.inserted)
            action = held_rows(q)[1].view(np.int64).ravel()
            np.testing.assert_array_equal(action[ids >= 700], 3_000_000 + np.arange(400)[-(ids >= 700).sum() :])


@pytest.mark.timeout(30)
def test_a_gone_table_gives_back_all_but_the_blocks_the_ring_has():
    from rlink_ucx.store.replay.storage import host_storage

    block, sb = 4, 4096  # blocks of 16 KiB: whole pages
    rows = host_storage(8 * block * sb).reshape(8 * block, sb)
    rows[:] = 7
    _forget_unlent([rows], {1, 6}, block)
    for b in range(8):
        flat = rows[b * block : (b + 1) * block].reshape(-1)
        if b in (1, 6):
            assert (flat == 7).all(), b  # the ring's: untouched
        else:  # whole pages only: a page shared with a lent block stays
            assert (flat[4096:-4096] == 0).all(), b


@pytest.mark.timeout(30)
def test_ring_wait_ready_reports_the_front_without_claiming():
    ring = small_ring()
    assert ring.wait_ready(1, 0.01) == (0, 0)
    feed(ring, 1, 0, steps(1, 0, 8))
    feed(ring, 1, 8, steps(1, 8, 5))
    assert ring.wait_ready(1, 1.0) == (13, 0)
    _, take = ring.take(6, 0.0)
    assert ring.wait_ready(20, 0.01) == (7, 6)  # times out short of 20; claims nothing
    ring.release(take)
    assert ring.ready_steps() == 7


@pytest.mark.timeout(30)
def test_ring_lend_chunk_with_a_replacement_installs_it():
    ring = small_ring()
    stream(ring, 1, 0, 16, frame=8)
    pieces, take = ring.take(16, 0.0)
    mine = [np.zeros(16 * f.step_bytes, dtype=np.uint8) for f in SCHEMA.fields]
    old = ring.chunks[0]
    assert ring.lend_chunk(pieces, mine) is old
    assert ring.chunks[0] is mine and not ring._lent  # not taken back for reuse
    ring.release(take)
    stream(ring, 2, 0, 64, frame=8)  # round the ring: chunk 0 again
    pieces, take = ring.take(16, 0.0)
    assert pieces[0].start == 0 and pieces[0].actor_id == 2
    np.testing.assert_array_equal(mine[1].view(np.int64), 2_000_000 + np.arange(16))

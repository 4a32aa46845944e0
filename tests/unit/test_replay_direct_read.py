"""Loading checkpoints with O_DIRECT into populated table memory: exact bytes, memory around a
region untouched, the buffered fallback, and tables of large odd-sized steps of every kind."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from rlink_ucx import ReplayDataset
from rlink_ucx.replay import CheckpointError
from rlink_ucx.store.replay import core as replay_core, direct_read, storage
from rlink_ucx.store.replay.block_table import BlockTable
from rlink_ucx.store.replay.direct_read import DirectReader
from rlink_ucx.store.ring import StepRing
from rlink_ucx.store.replay.storage import GUARD_AFTER, GUARD_BEFORE, host_storage, populated
from rlink_ucx.wire.codec import Schema
from tests.unit.replay_helpers import FakeLearner, feed, wait_for

BIG = Schema.from_spec({"frame": ("uint8", (37, 111)), "action": ("int64", ()), "done": ("bool", ())})  # 4107 B


def reader(path) -> DirectReader:
    r = DirectReader.open(path)
    if r is None:
        pytest.skip(f"{path.parent}'s file system refuses O_DIRECT")
    return r


@pytest.mark.timeout(60)
def test_direct_reads_land_exactly_and_leave_the_memory_around_them_alone(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 5 * 4096 + 77, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    r = reader(tmp_path / "f")
    rng = np.random.default_rng(1)
    try:
        for _ in range(300):
            offset = int(rng.integers(0, data.size))
            size = int(rng.integers(0, 3 * 4096))
            store = host_storage(4 * 4096)
            store[:] = 0xA5
            edges = (store.ctypes.data - GUARD_BEFORE, store.nbytes + GUARD_BEFORE + GUARD_AFTER)
            outside = ctypes.string_at(*edges)
            at = int(rng.integers(0, store.size - size + 1))
            got = r.read_into(store[at : at + size], offset)
            want = data[offset : offset + size]
            assert got == want.size  # fewer at the end of the file
            np.testing.assert_array_equal(store[at : at + got], want)
            assert (store[:at] == 0xA5).all() and (store[at + size :] == 0xA5).all()
            after = ctypes.string_at(*edges)
            assert after[:GUARD_BEFORE] == outside[:GUARD_BEFORE] and after[-GUARD_AFTER:] == outside[-GUARD_AFTER:]
    finally:
        r.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kernel_populates", [True, False])
def test_populated_views_come_in_order_and_keep_what_the_caller_wrote(monkeypatch, kernel_populates):
    if not kernel_populates:  # an older kernel: the helpers touch pages ahead, and the caller waits
        monkeypatch.setattr(storage, "populate", lambda view, stop=None: False)
    store = host_storage(40 * 8192)
    views = [store[i * 8192 : (i + 1) * 8192] for i in range(40)]
    seen = []
    for i, v in enumerate(populated(views, threads=3)):
        v[:] = i + 1  # as a read fills it, while helpers work on the views ahead
        seen.append(i)
    assert seen == list(range(40))
    assert all((v == i + 1).all() for i, v in enumerate(views))  # nothing written after the caller


def big_steps(actor: int, seq: int, n: int) -> dict[str, np.ndarray]:
    s = np.arange(seq, seq + n)
    frame = (s[:, None, None] * 7 + np.arange(37 * 111).reshape(37, 111) + actor) % 251
    return {"frame": frame.astype(np.uint8), "action": (actor * 1_000_000 + s).astype(np.int64), "done": s % 3 == 0}


def filled(storage: str, ring: StepRing, n: int, capacity: int, **kw) -> ReplayDataset:
    r = ReplayDataset(FakeLearner(ring), capacity=capacity, batch_size=16, storage=storage, seed=0, **kw)
    for lo in range(0, n, 8):
        while ring.grantable() < 8:
            pass
        feed(ring, 1, lo, big_steps(1, lo, min(8, n - lo)))
    assert wait_for(lambda: r.inserted == n, 30)
    return r


def rows_of(r: ReplayDataset) -> list[np.ndarray]:
    t = r._core.table
    ids = np.arange(t.first, t.inserted)
    outs = [np.empty((ids.size, f.step_bytes), dtype=np.uint8) for f in t.schema.fields]
    if isinstance(t, BlockTable) or not t.on_device:
        t.gather(ids, outs)
    else:
        outs = [np.asarray(rows)[ids % t.capacity] for rows in t.rows]
    return outs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage,blocks", [("host", False), ("host", True), ("device", False)])
@pytest.mark.parametrize("how", ["direct", "buffered", "fails midway"])
def test_a_large_table_loads_byte_for_byte(tmp_path, monkeypatch, storage, blocks, how):
    """Odd step sizes (4107 B) over several 8 MiB chunks, two runs of slots (the table wrapped):
    the O_DIRECT reads are misaligned against memory in every possible way."""
    if blocks:
        monkeypatch.setattr(replay_core, "ADOPT_MIN_BYTES", 0)
    ring = StepRing(BIG, 64 * BIG.step_bytes, 8, chunk_steps=16)
    capacity = 5003  # 20.5 MB of frames
    r = filled(storage, ring, 7777, capacity)
    assert isinstance(r._core.table, BlockTable) == blocks
    r.close()
    r.save(tmp_path / "c")
    reads = []
    if how == "buffered":
        monkeypatch.setattr(DirectReader, "open", classmethod(lambda cls, path: None))
    else:
        real = DirectReader.read_into

        def counted(self, dest, offset):
            reads.append(offset)
            if how == "fails midway" and len(reads) == 2:
                raise OSError(22, "alignment")  # as from a device that wants more alignment
            return real(self, dest, offset)

        monkeypatch.setattr(DirectReader, "read_into", counted)
    with ReplayDataset.load(tmp_path / "c", r.learner, storage=storage) as q:
        assert len(q) == capacity and q.inserted == 7777
        for got, want in zip(rows_of(q), rows_of(r)):
            np.testing.assert_array_equal(got, want)
        if how != "buffered" and direct_read.DirectReader.open(tmp_path / "c" / "field_0.npy") is not None:
            assert len(reads) >= 2 if how == "fails midway" else len(reads) > 3


@pytest.mark.timeout(60)
def test_corruption_is_still_caught_when_reading_directly(tmp_path):
    ring = StepRing(BIG, 64 * BIG.step_bytes, 8, chunk_steps=16)
    with filled("host", ring, 3000, 3000) as r:
        r.save(tmp_path / "c")
    path = tmp_path / "c" / "field_0.npy"
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5000)
        f.write(b"\x00" * 7)
    with pytest.raises(CheckpointError, match="checksum"):
        ReplayDataset.load(tmp_path / "c", FakeLearner(None))

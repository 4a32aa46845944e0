"""Buffers committed ahead of use (rlink_ucx/_memory.py): pages are populated without their
contents changing, and the learner's ring and an actor's frame buffers come from them."""

import ctypes
import mmap
import sys
import time

import numpy as np
import pytest

from rlink_ucx._memory import Reserve, populate
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import Schema

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux")

PAGE = mmap.PAGESIZE


def resident_pages(view: np.ndarray) -> int:
    """How many of ``view``'s pages are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-view.nbytes // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(view.ctypes.data, view.nbytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def test_populate_makes_pages_resident_and_keeps_contents():
    mm = mmap.mmap(-1, 64 * PAGE)
    view = np.frombuffer(mm, np.uint8)
    view[5 * PAGE : 6 * PAGE] = 7  # data written before populating must survive it
    assert resident_pages(view) == 1
    assert populate(view) is True
    assert resident_pages(view) == 64
    assert (view[5 * PAGE : 6 * PAGE] == 7).all() and view[: 5 * PAGE].sum() == 0 and view[6 * PAGE :].sum() == 0
    del view
    mm.close()


def test_reserve_populates_in_the_background_and_carves_aligned_arrays():
    reserve = Reserve(256 * PAGE, "test")
    deadline = time.monotonic() + 10
    while resident_pages(reserve._all) < 256 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident_pages(reserve._all) == 256
    a = reserve.take(100)
    b = reserve.take(PAGE)
    assert a is not None and b is not None and a.nbytes == 100 and b.nbytes == PAGE
    assert b.ctypes.data - a.ctypes.data == 128  # the next cache line after a's 100 bytes
    a[:] = 1
    b[:] = 2
    assert a.sum() == 100 and b.sum() == 2 * PAGE  # carved arrays do not overlap
    assert reserve.take(256 * PAGE) is None  # no room left: the caller uses plain memory
    reserve.close()
    assert reserve.take(1) is None
    assert a.sum() == 100  # what was carved stays valid after close


def test_reserve_close_stops_its_thread():
    import threading

    reserve = Reserve(64 << 20, "stopme")
    reserve.close()
    assert not [t for t in threading.enumerate() if t.name == "rlink-populate-stopme"]


def test_ring_chunks_and_lent_spares_come_from_the_reserve():
    schema = Schema.from_spec({"x": ("int64", (4,)), "done": ("bool", ())})
    reserve = Reserve(1 << 20, "ring-test")
    ring = StepRing(schema, 64 * 33, max_frame_steps=8, chunk_steps=8, reserve=reserve)
    lo, hi = reserve._all.ctypes.data, reserve._all.ctypes.data + reserve.size

    def inside(arrays):
        return all(lo <= a.ctypes.data and a.ctypes.data + a.nbytes <= hi for a in arrays)

    assert all(inside(chunk) for chunk in ring.chunks)
    ring.grant(8)
    seg = ring.reserve(8, actor_id=1, seq=0, version=0)
    ring.commit(seg)
    pieces, take = ring.take(8, timeout=1)
    lent = ring.lend_chunk(pieces)
    assert lent is not None and inside(ring.chunks[0])  # the spare swapped in is populated memory too
    ring.release(take)
    ring.close()


def test_ring_without_room_in_the_reserve_makes_its_own():
    schema = Schema.from_spec({"x": ("uint8", (4096,))})
    small = Reserve(4096 * 4, "small")
    ring = StepRing(schema, 4096 * 64, max_frame_steps=4, chunk_steps=4, reserve=small)
    assert len(ring._reserves) == 2 and ring._reserves[1].size >= 4096 * (64 + 4 * 4) - small.size
    ring.close()


def test_a_reserve_is_private_memory_not_shared_with_forked_children():
    reserve = Reserve(4 * PAGE, "private")
    start = reserve._all.ctypes.data
    with open("/proc/self/maps") as maps:
        line = next(ln for ln in maps if int(ln.split("-")[0], 16) <= start < int(ln.split()[0].split("-")[1], 16))
    assert line.split()[1] == "rw-p", line  # Python's anonymous mmap default would be rw-s (shmem)
    reserve.close()


def test_lent_chunks_from_the_reserve_come_back_whatever_the_pools_size():
    # A chunk carved from the reserve and dropped would free nothing, and the next spare would
    # be fresh memory: the learner's RSS crept up by ~40 MiB over a 2-minute soak of 4 MiB steps.
    schema = Schema.from_spec({"x": ("uint8", (4096,))})
    reserve = Reserve(64 << 20, "lend-test")
    ring = StepRing(schema, 4096 * 64, max_frame_steps=4, chunk_steps=4, reserve=reserve)
    lo, hi = reserve._all.ctypes.data, reserve._all.ctypes.data + reserve.size
    held, seq = [], 0
    for _ in range(8):  # more batches held at once than the pool keeps (4)
        ring.grant(4)
        ring.commit(ring.reserve(4, actor_id=1, seq=seq, version=0))
        pieces, take = ring.take(4, timeout=1)
        held.append(list(ring.lend_chunk(pieces)))  # the caller's batch references the arrays
        ring.release(take)
        seq += 4
    assert all(lo <= arrays[0].ctypes.data < hi for arrays in held)  # spares came from the reserve
    held.clear()  # the caller drops every batch
    ring.grant(4)
    ring.commit(ring.reserve(4, actor_id=1, seq=seq, version=0))
    pieces, take = ring.take(4, timeout=1)
    ring.lend_chunk(pieces)  # reclaims the dropped chunks on the way
    assert len(ring._pool) >= 7  # all eight came back but the one just swapped in
    ring.release(take)
    ring.close()


def test_a_reserve_with_ahead_commits_only_what_is_carved_plus_ahead():
    """An actor's frame memory is sized for its worst case; populated whole, 64 actors of one
    process committed 2.5 GiB. With ``ahead`` it grows as frame buffers are carved."""
    mib = 1 << 20
    reserve = Reserve(40 * mib, "ahead-test", ahead=2 * mib)
    assert reserve.populating == 2 * mib
    first = reserve.take(mib)
    assert first is not None and reserve.populating == 3 * mib
    reserve.take(mib)
    assert reserve.populating == 4 * mib
    assert reserve.take(40 * mib) is None and reserve.populating == 4 * mib  # no room: nothing grows
    rest = reserve.take(36 * mib)
    assert rest is not None and reserve.populating == 40 * mib  # never past the end
    lazy = Reserve(8 * mib, "lazy", ahead=2 * mib, lazy=True)
    assert lazy.populating == 0 and lazy.take(mib) is not None and lazy.populating == 0  # not even what was carved
    assert lazy.take(mib) is not None and lazy.populating == 4 * mib  # from the start: both blocks, and two ahead
    lazy.close()
    whole = Reserve(8 * mib, "whole")
    assert whole.populating == 8 * mib  # the default: all of it from the start
    reserve.close()
    whole.close()

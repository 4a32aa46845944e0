"""Host memory for replay tables: allocated with guard space around it, populated in bulk.

A table's field storage is one flat uint8 buffer with :data:`GUARD_BEFORE` bytes of the same
mapping before it and :data:`GUARD_AFTER` after it. A checkpoint load reads the files with
``O_DIRECT`` (``direct_read.py``), whose reads must start and end on 4 KiB boundaries of both
the file and the memory; the storage rarely lines up with the file that way, so a read may
write up to those many bytes past either end of the region it fills, and puts them back right
after. The guards make that always land in memory of ours.

Fresh pages are populated by the kernel (``MADV_POPULATE_WRITE``, see ``rlink_ucx/_memory.py``)
from a few helper threads, not touched one by one from Python: in a VM whose host backs guest
memory lazily (this project's, measured in docs/replay.md) each first touch is a fault handled
by the host, and several threads in flight overlap them.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..._memory import populate

__all__ = ["GUARD_AFTER", "GUARD_BEFORE", "discard", "host_storage", "populate_all", "populated"]

PAGE = 4096
GUARD_BEFORE = PAGE  # a direct read starts at most this far before its region...
GUARD_AFTER = 2 * PAGE  # ...and ends at most this far after it
THREADS = 4  # helper threads populating; 4 beat 2 and 8 for a 2-core VM (docs/replay.md)
# Storage starts this far past a page, as numpy's own large arrays do (malloc's header): a
# gather copies rows into staging arrays from np.empty, and rows equally aligned in both copy
# fastest (page-aligned rows sampled 3-5% fewer batches/s here).
_SKEW = 16
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_DONTNEED = 4

_madvise: Any = None
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _madvise = None


def host_storage(nbytes: int, *, pin: bool = False, huge: bool = True) -> np.ndarray:
    """``nbytes`` of uint8 host memory, inside a mapping that extends the guards on both sides.

    ``pin``: page-locked (CUDA pinned) memory, populated by the allocation itself. Otherwise a
    private anonymous mapping, whose pages are not populated yet; ``huge`` asks for transparent
    huge pages, as numpy does for large arrays (a gather crosses fewer TLB entries: ~10% more
    batches/s here) but not for a table a load is about to fill: in this VM a huge page faults
    in at a third of the speed of small ones from several threads (docs/replay.md).
    """
    lead = GUARD_BEFORE + _SKEW
    total = lead + nbytes + GUARD_AFTER
    if pin:
        import torch

        return torch.empty(total, dtype=torch.uint8, pin_memory=True).numpy()[lead : lead + nbytes]
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    whole = np.frombuffer(mmap.mmap(-1, total, flags=private), dtype=np.uint8)  # the array keeps the mapping
    if huge and _madvise is not None:
        _madvise(whole.ctypes.data, total, _MADV_HUGEPAGE)  # advice only: no error if refused
    return whole[lead : lead + nbytes]


def discard(view: np.ndarray) -> None:
    """Give the whole pages inside ``view`` (private anonymous memory nobody reads any more)
    back to the system now, although the mapping stays: they read as zeros afterwards."""
    if _madvise is None or view.nbytes == 0:
        return
    lo = -(-view.ctypes.data // PAGE) * PAGE
    hi = (view.ctypes.data + view.nbytes) // PAGE * PAGE
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_DONTNEED)


def populate_all(array: np.ndarray, chunk: int = 8 << 20) -> None:
    """Fault in every page of ``array`` now (``THREADS`` threads), so inserts never do."""
    flat = array.reshape(-1)
    views = [flat[lo : lo + chunk] for lo in range(0, flat.size, chunk)]

    def work(first: int) -> None:
        for view in views[first::THREADS]:
            if not populate(view):
                view[::PAGE] = 0  # no MADV_POPULATE_WRITE (older kernel): touch each page

    _run(work, min(THREADS, len(views)))


def populated(views: list[np.ndarray], threads: int = THREADS) -> Iterator[np.ndarray]:
    """``views`` in order, while helper threads populate the pages of those ahead of the caller:
    a load's page faults overlap its file reads. A view the caller reaches first, it faults in
    itself (populating never changes contents, so a helper may still be at it). Where the kernel
    cannot populate, the helpers touch the views ahead instead, which writes, so the caller then
    waits for each. Closing the generator early stops the helpers at their next view."""
    if not views:
        return
    if not populate(views[0]):
        yield from _touched_ahead(views, threads)
        return
    reached = 0
    stop = threading.Event()

    def work(first: int) -> None:
        for i in range(first, len(views), threads):
            if stop.is_set():
                return
            if i > reached:
                populate(views[i])

    helpers = _start(work, min(threads, len(views)))
    try:
        for i, view in enumerate(views):
            reached = i  # the helpers skip what the caller has reached
            yield view
    finally:
        stop.set()
        for helper in helpers:
            helper.join()


def _touched_ahead(views: list[np.ndarray], threads: int) -> Iterator[np.ndarray]:
    done = [threading.Event() for _ in views]
    stop = threading.Event()

    def work(first: int) -> None:
        for i in range(first, len(views), threads):
            if stop.is_set():
                return
            views[i][::PAGE] = 0
            done[i].set()

    helpers = _start(work, min(threads, len(views)))
    try:
        for view, ready in zip(views, done):
            ready.wait()
            yield view
    finally:
        stop.set()
        for helper in helpers:
            helper.join()


def _start(work: Any, threads: int) -> list[threading.Thread]:
    helpers = [threading.Thread(target=work, args=(t,), name="rlink-replay-populate", daemon=True)
               for t in range(threads)]  # fmt: skip
    for helper in helpers:
        helper.start()
    return helpers


def _run(work: Any, threads: int) -> None:
    for helper in _start(work, threads):
        helper.join()

"""Buffers committed ahead of use, so the data path never pays for first touches.

The first write to a fresh page is a page fault, an order of magnitude slower than a write to
warm memory (``python bench/large_steps.py`` prints this machine's figures; docs/benchmarks.md,
"Figures behind the code's choices"): a receive ring written at fault speed would cost the
learner its first second of steps.

So the buffers the data path writes at full speed (the learner's receive ring, an actor's frame
buffers) come from a :class:`Reserve`: one anonymous or shared mapping whose pages a background
thread populates with ``MADV_POPULATE_WRITE`` (Linux >= 5.14). That call never changes the
contents, so the data path may already use the pages while it runs. Where it is missing (older
kernels, other systems) the pages fault in on first use.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading

import numpy as np

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # linux/mman.h
_STEP = 8 << 20  # populate in slices, so close() stops it promptly
_ALIGN = 64  # carved arrays start on a cache line

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - no libc symbol
        _madvise = None


def populate(view: np.ndarray, stop: threading.Event | None = None) -> bool:
    """Fault in every page of ``view`` (a uint8 array over a mapping) for writing, without
    changing its contents. Returns False where the kernel cannot (nothing was done)."""
    if _madvise is None or view.nbytes == 0:
        return False
    start = view.ctypes.data
    first = start - start % mmap.PAGESIZE  # the mapping begins on a page, so this stays inside it
    end = start + view.nbytes
    for at in range(first, end, _STEP):
        if stop is not None and stop.is_set():
            return True
        if _madvise(at, min(_STEP, end - at), _MADV_POPULATE_WRITE) != 0:
            log.debug("MADV_POPULATE_WRITE unavailable (errno %d): pages fault in on first use", ctypes.get_errno())
            return False
    return True


class _Populator:
    """:func:`populate` of a view on a daemon thread, which holds the view (and so the mapping
    under it) until it is done."""

    def __init__(self, view: np.ndarray, name: str):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if _madvise is not None and view.nbytes:
            self._thread = threading.Thread(target=populate, args=(view, self._stop), name=f"rlink-populate-{name}",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop at the next slice and wait for it (one slice: milliseconds)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)


class Reserve:
    """``nbytes`` of memory, populated in the background ahead of use, out of which arrays are
    carved once each (:meth:`take`): fresh anonymous memory, or ``nbytes`` at ``offset`` of a
    given ``mapping`` (e.g. a shared memfd). The memory lives as long as the reserve or any
    array carved from it.

    ``ahead``: how far past what was carved the pages are kept populated (None: all of it from
    the start). ``lazy``: nothing at all until the second :meth:`take` (an shm actor's first
    frame buffer, whose few pages fault in as they are written). An actor's frame memory is sized for its worst case (every frame kept for
    resending) and most actors use a frame or two of it: populated whole, 64 actors of one
    process would commit 2.5 GiB.
    """

    def __init__(self, nbytes: int, name: str = "reserve", *, mapping: mmap.mmap | None = None, offset: int = 0,
                 align: int = _ALIGN, ahead: int | None = None, lazy: bool = False):  # fmt: skip
        self.size = max(0, int(nbytes))
        self._align = align
        self._name = name
        # Private, like malloc's: Python's default for anonymous maps is MAP_SHARED (shmem),
        # which a forked child would share and which counts as shared memory.
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self._mm = mapping if mapping is not None else mmap.mmap(-1, max(self.size, 1), flags=private)
        self._all: np.ndarray | None = np.frombuffer(self._mm, np.uint8, self.size, offset)
        self._next = 0
        self._ahead = self.size if ahead is None else max(0, int(ahead))
        self._populated = 0  # bytes handed to a populator so far
        self._populators: list[_Populator] = []
        self._lazy = lazy  # nothing populated (not even what is carved) until the second take
        if not lazy:
            self._populate_to(self._ahead)

    @property
    def free(self) -> int:
        return self.size - self._next

    @property
    def populating(self) -> int:
        """Bytes handed to the background populator so far (what the reserve commits)."""
        return self._populated

    def take(self, nbytes: int) -> np.ndarray | None:
        """A fresh ``nbytes`` uint8 array from the reserve, or None when it has no room left."""
        start = self._next
        if self._all is None or start + nbytes > self.size:
            return None
        self._next = start + -(-nbytes // self._align) * self._align
        if not (self._lazy and start == 0):  # lazy: from the second take on, the first block included
            self._populate_to(self._next + self._ahead)
        return self._all[start : start + nbytes]

    def _populate_to(self, end: int) -> None:
        end = min(self.size, end)
        if self._all is None or end <= self._populated:
            return
        view, self._populated = self._all[self._populated : end], end
        self._populators = [p for p in self._populators if p.running]
        self._populators.append(_Populator(view, self._name))

    def close(self) -> None:
        """Stop populating and drop the reserve's own view; the memory goes with the last array
        carved from it."""
        for populator in self._populators:
            populator.stop()
        self._all = None

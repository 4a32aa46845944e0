"""Reading a file straight into a table's memory with ``O_DIRECT``: no page cache in between.

A buffered read of a checkpoint fills the page cache (fresh memory too, on top of the new
table's) and then copies it out; an ``O_DIRECT`` read has the disk write into the table.
Measured on this project's VM, into a table being populated ahead of the reads: 1.3-1.7 GB/s
against 0.4-0.5 GB/s buffered (docs/replay.md).

``O_DIRECT`` wants the file offset, the memory address and the length on 4 KiB boundaries (a
safe value for every common device). A region of the table seldom starts where its bytes sit
in the file modulo 4 KiB, so :meth:`DirectReader.read_into` reads whole aligned blocks to the
aligned address nearest the region, moves them into place when the two alignments differ, and
puts back the few bytes it wrote outside the region. That needs the memory around the region
(at most ``GUARD_BEFORE`` bytes before, ``GUARD_AFTER`` after) to be the caller's and unread by
anyone else meanwhile: the table storage of ``storage.py`` while a load fills it.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .storage import GUARD_AFTER, GUARD_BEFORE, PAGE

__all__ = ["DirectReader"]


class DirectReader:
    """One file opened with ``O_DIRECT`` (see :meth:`open`)."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, path: os.PathLike[str] | str) -> DirectReader | None:
        """The file opened for direct reads, or None where that is not possible (no
        ``O_DIRECT`` on this system, or a file system that refuses it, such as tmpfs)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            return cls(os.open(path, os.O_RDONLY | flag))
        except OSError:
            return None

    def read_into(self, dest: np.ndarray, offset: int) -> int:
        """Fill ``dest`` (contiguous uint8, with the guard space around it) with the file's
        bytes from ``offset``; returns how many it got (fewer at the end of the file).
        Raises OSError where the device wants larger alignment (the caller reads buffered)."""
        start, size = dest.ctypes.data, dest.nbytes
        if size == 0:
            return 0
        skip = offset % PAGE  # file bytes read before ``offset``, to start on a block
        shift = (offset - start) % PAGE  # the data land this far past ``start``, then move down
        low = start + shift - skip  # first byte written: aligned like the file block
        span = -(-(skip + size) // PAGE) * PAGE
        high = low + span  # one past the last byte written
        assert start - low <= GUARD_BEFORE and high - (start + size) <= GUARD_AFTER
        before = ctypes.string_at(low, start - low) if low < start else b""
        after = ctypes.string_at(start + size, high - start - size) if high > start + size else b""
        got = 0
        try:
            window = memoryview((ctypes.c_ubyte * span).from_address(low)).cast("B")
            while got < span:
                n = os.preadv(self.fd, [window[got:]], offset - skip + got)
                got += max(n, 0)
                if n <= 0 or n % PAGE:  # a read that ends off a block ended at the end of the file
                    break
            got = max(0, min(size, got - skip))
            if shift and got:
                ctypes.memmove(start, start + shift, got)
        finally:  # what lay outside ``dest`` goes back, whatever happened
            if before:
                ctypes.memmove(low, before, len(before))
            if after:
                ctypes.memmove(start + size, after, len(after))
        return got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

"""The shared memory of the ``shm`` plane: sealed ``memfd`` regions mapped by both processes.

The learner's ring (one per session) can never shrink, so a misbehaving actor cannot make the
learner's reads fault; it is announced as ``(pid, fd, nonce, size)`` and mapped through
``/proc/<pid>/fd/<fd>``, which only a process of the same user in the same PID namespace may
open; the nonce proves the right object was mapped. An actor's arena holds its frame buffers
the same way, mapped by the learner.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import stat
import struct
from typing import Any

import numpy as np

from ..._memory import Reserve
from . import cma

DATA_OFFSET = 4096  # the first page holds the nonce; the ring's bytes start page-aligned
NONCE_BYTES = 16
RING_NAME = "rlink-shm"  # the learner's ring, one per session
ARENA_NAME = "rlink-arena"  # an actor's frame buffers, one per actor
EXTENT = struct.Struct("<QQ")  # a payload extent: offset in the arena (or an address), length
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0


def available() -> bool:
    """Whether this platform can create and map the ring (Linux with memfd and seals)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")


def open_memfd(pid: int, fd: int, size: int, name: str, mode: int) -> int:
    """A descriptor (``mode``: ``os.O_RDONLY`` or ``os.O_RDWR``) of another process's memfd
    ``name`` of ``size`` data bytes, announced as its descriptor ``fd``; ``OSError`` when it is
    not reachable from here or is something else. The caller checks the nonce."""
    path = f"/proc/{pid}/fd/{fd}"
    # In another PID namespace the same numbers name some other process's file: look before
    # opening (never open a device or a FIFO by accident).
    if not os.readlink(path).startswith(f"/memfd:{name} "):
        raise OSError(f"{path} is not an rlink {name}")
    own = os.open(path, mode | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    info = os.fstat(own)
    if not stat.S_ISREG(info.st_mode) or info.st_size != DATA_OFFSET + size:
        os.close(own)
        raise OSError(f"{path} is not the announced {name}")
    return own


# Copies up to this size slice the mapping and keep the GIL: ``ctypes.memmove`` releases it,
# and a release around a small field's copy is a likely thread switch (to another pump, the
# consumer, the I/O loop) that costs more than the copy itself (docs/benchmarks.md).
SLICE_BYTES = 64 * 1024


class ShmRing:
    """A sealed shared memfd, mapped: ``size`` data bytes after the nonce page. The learner's
    ring (a byte stream) or an actor's arena (its frame buffers)."""

    def __init__(self, mm: mmap.mmap, size: int, fd: int | None = None):
        self.mm = mm
        self.size = size
        self.fd = fd  # the learner's memfd until the actor has mapped it
        self.base = cma.address(memoryview(mm)) + DATA_OFFSET

    @classmethod
    def create(cls, size: int, name: str = RING_NAME) -> tuple[ShmRing, bytes]:
        """A new sealed region and the nonce written into it."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, DATA_OFFSET + size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, DATA_OFFSET + size)
        except BaseException:
            os.close(fd)
            raise
        nonce = secrets.token_bytes(NONCE_BYTES)
        mm[:NONCE_BYTES] = nonce
        return cls(mm, size, fd), nonce

    @classmethod
    def open(cls, pid: int, fd: int, nonce: bytes, size: int, name: str = RING_NAME) -> ShmRing:
        """Map the other side's region; ``OSError`` when it is not reachable from here."""
        path = f"/proc/{pid}/fd/{fd}"
        own = open_memfd(pid, fd, size, name, os.O_RDWR)
        try:
            # Unsealed, its owner could shrink it under our mapping: reads would fault (SIGBUS).
            if fcntl.fcntl(own, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise OSError(f"{path} is not sealed against shrinking")
            mm = mmap.mmap(own, DATA_OFFSET + size)
        finally:
            os.close(own)
        if mm[:NONCE_BYTES] != nonce:
            mm.close()
            raise OSError(f"/proc/{pid}/fd/{fd} is another object (nonce differs)")
        return cls(mm, size)

    def release_fd(self) -> None:
        """The learner's descriptor is no longer needed once the actor mapped the ring."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Unmap (the mapping holds a descriptor of its own). Only once no thread can copy
        through ``base`` any more: callers make sure of that."""
        self.release_fd()
        self.mm.close()

    def copy_in(self, pos: int, src: bytes | memoryview) -> None:
        """Copy ``src`` into the ring at stream position ``pos`` (wrapping)."""
        addr = None if len(src) <= SLICE_BYTES else cma.address(src)
        for at, done, k in self._spans(pos, len(src)):
            if addr is None:
                self.mm[DATA_OFFSET + at : DATA_OFFSET + at + k] = src[done : done + k]
            else:
                ctypes.memmove(self.base + at, addr + done, k)

    def copy_out(self, pos: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes from stream position ``pos`` (wrapping) into ``dst``."""
        addr = None if len(dst) <= SLICE_BYTES else cma.address(dst)
        for at, done, k in self._spans(pos, len(dst)):
            if addr is None:
                dst[done : done + k] = self.mm[DATA_OFFSET + at : DATA_OFFSET + at + k]
            else:
                ctypes.memmove(addr + done, self.base + at, k)

    def _spans(self, pos: int, n: int) -> list[tuple[int, int, int]]:
        """``n`` bytes from stream position ``pos`` as at most two ``(ring offset, offset in
        the caller's buffer, length)`` pieces: the ring wraps once at most."""
        at = pos % self.size
        k = min(n, self.size - at)
        return [(at, 0, k), (0, k, n - k)] if k < n else [(at, 0, n)]

    def extents(self, views: list[memoryview]) -> bytes | None:
        """``views`` as packed (offset, length) extents if every one lies in this region."""
        out = []
        for view in views:
            at = cma.address(view) - self.base
            if not 0 <= at <= self.size - len(view):
                return None
            out.append(EXTENT.pack(at, len(view)))
        return b"".join(out)

    def views(self, extents: list[tuple[int, int]]) -> list[memoryview]:
        """The region's ``extents`` (validated) as views, for a copy made at once: a view kept
        would keep the mapping from closing."""
        whole = memoryview(self.mm)
        return [whole[DATA_OFFSET + at : DATA_OFFSET + at + n] for at, n in extents]

    def copy_extents(self, extents: list[tuple[int, int]], dst: list[memoryview]) -> None:
        """Copy the region's ``extents`` (validated) into ``dst``, in order."""
        i, used = 0, 0  # position in dst
        for at, n in extents:
            while n:
                view = dst[i]
                k = min(n, len(view) - used)
                ctypes.memmove(cma.address(view) + used, self.base + at, k)
                at, n, used = at + k, n - k, used + k
                if used == len(view):
                    i, used = i + 1, 0


class Arena:
    """An actor's frame buffers in a sealed memfd the learner maps: frames whose payload lies
    here reach the learner with one copy, straight out of the frame buffer. Blocks are handed
    out once and live as long as the actor (frame buffers are reused, never freed)."""

    def __init__(self, size: int, ahead: int | None = None, lazy: bool = False):
        self.region, self.nonce = ShmRing.create(size, ARENA_NAME)
        # Populated ``ahead`` of the frames written into it (rlink_ucx/_memory.py).
        self._memory = Reserve(size, "arena", mapping=self.region.mm, offset=DATA_OFFSET, align=4096, ahead=ahead,
                               lazy=lazy)  # fmt: skip

    def describe(self) -> list[Any]:
        assert self.region.fd is not None
        return [os.getpid(), self.region.fd, self.nonce, self.region.size]

    def block(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of arena memory (page-aligned), or None once the arena is full."""
        return self._memory.take(nbytes)


    def close(self) -> None:
        """The actor is closing; the mapping goes once no frame buffer uses it any more."""
        self._memory.close()
        self.region.release_fd()
        try:
            self.region.mm.close()
        except BufferError:  # frame buffers still reference it: unmapped with the last of them
            pass

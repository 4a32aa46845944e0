"""Same-host fan-out: snapshots in sealed shared memory that actors on the host read directly.

A weights stream over a socket copies every byte twice per actor (into the kernel, out of it),
and the learner sends each actor its own copy. An actor on the learner's host can instead read
the learner's snapshot buffer itself: one copy, made by the actor's own core, and nothing for the
learner to send. The buffer is a sealed ``memfd`` (``transport/shm/memory.py``), named by
``(pid, fd, nonce, size)`` and opened through ``/proc/<pid>/fd/<fd>``, which only a process of
the same user in the same PID namespace may open. The bytes are trusted only once every bucket
matched its keyed tag under a Seal the actor verified, as on a weights stream: a buffer reused
or changed while it was read fails its tags, and the actor gets the version on a weights stream
instead.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..transport.shm.memory import DATA_OFFSET, NONCE_BYTES, ShmRing, available, open_memfd

__all__ = ["NAME", "SharedBuffer", "available", "holder_gone", "location", "read_into"]

NAME = "rlink-weights"
_READ_PIECE = 8 << 20  # bytes per read: bounds the time the caller cannot be interrupted


class SharedBuffer:
    """A snapshot's flat buffer in a sealed memfd, and where actors find it. It holds no view
    of its memory: whoever holds :meth:`array`'s result decides how long the bytes live."""

    __slots__ = ("nbytes", "region", "where")

    def __init__(self, nbytes: int):
        self.region, nonce = ShmRing.create(nbytes, NAME)
        self.nbytes = nbytes
        self.where = [os.getpid(), self.region.fd, nonce, nbytes]

    def array(self) -> np.ndarray:
        return np.frombuffer(self.region.mm, dtype=np.uint8, count=self.nbytes, offset=DATA_OFFSET)

    def close(self) -> None:
        """Close the descriptor; the mapping goes with the last view of the array."""
        self.region.release_fd()


def location(where: Any) -> tuple[int, int, bytes, int] | None:
    """``where`` as [pid, fd, nonce, bytes] if it has that shape and those types, else None.
    Checked by type before use: a hostile size must not become an allocation or a path."""
    if not isinstance(where, list) or len(where) != 4:
        return None
    pid, fd, nonce, size = where
    if type(pid) is not int or type(fd) is not int or type(nonce) is not bytes or type(size) is not int:
        return None
    if len(nonce) != NONCE_BYTES or pid <= 0 or fd < 0 or size < 0:
        return None
    return pid, fd, nonce, size


def read_into(where: Any, dst: np.ndarray, on_piece: Any = None) -> None:
    """Copy the shared buffer ``where`` (as the learner announced it) into ``dst``, in order;
    ``on_piece(done)`` after each piece with the bytes read so far. ``OSError`` when it cannot
    be opened from here (another host, PID namespace or user); ``ProtocolError`` when it is
    malformed or smaller than ``dst``."""
    checked = location(where)
    if checked is None:
        raise ProtocolError("malformed shared weights location")
    pid, fd, nonce, size = checked
    if size != len(dst):
        raise ProtocolError(f"shared weights of {size} bytes announced for a {len(dst)}-byte version")
    path = f"/proc/{pid}/fd/{fd}"
    own = open_memfd(pid, fd, size, NAME, os.O_RDONLY)
    try:
        if os.pread(own, NONCE_BYTES, 0) != nonce:
            raise OSError(f"{path} is another object (nonce differs)")
        view = dst.data
        done = 0
        while done < size:
            n = os.preadv(own, [view[done : min(size, done + _READ_PIECE)]], DATA_OFFSET + done)
            if n <= 0:
                raise OSError(f"{path} ended after {done} of {size} bytes")
            done += n
            if on_piece is not None:
                on_piece(done)
    finally:
        os.close(own)


def holder_gone(where: Any) -> bool:
    """Whether the process that announced ``where`` has ended (its copy went with it), as
    against one that is there but whose memory cannot be opened from here."""
    pid = where[0] if isinstance(where, list) and where else None
    return type(pid) is int and pid > 0 and not os.path.exists(f"/proc/{pid}")

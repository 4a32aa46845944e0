"""Reading another process's memory directly (``process_vm_readv``, "cross-memory attach").

On the shm plane, a large payload that is not in the actor's arena (a large ``put`` sent
straight from the caller's arrays, or a frame buffer outside the arena) is read by the learner
straight out of the actor's memory: one copy, done by the kernel, instead of one into the
shared ring and one out of it. UCX's ``cma`` transport does the same.

The kernel allows it only where the reader may ptrace the target: same user, and with Yama's
``ptrace_scope`` >= 1 or a container's default seccomp profile usually not at all. rlink never
widens that (no ``PR_SET_PTRACER``). The pid read from is never the peer's word alone: the
kernel must show that process holding the actor's end of the data connection
(``transport/shm/peer.py``), and a :class:`Process` handle (a pidfd) taken before that check
tells when the process is gone, so a pid reused by another process is never read from and
kept. Whether reading works is then probed per session: the actor shows a random nonce at an
address in its memory (:class:`Probe`), and the learner reads it back (:func:`verify`) before
it accepts a frame by address. The learner only ever writes into its own buffers, of the sizes
it validated; a bad address costs the actor its connection.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import select
import sys
from typing import Any

import numpy as np

# Smaller payloads go through the ring. A read by address is a round trip the actor waits for
# (the caller's arrays must not change until read), while the ring pipelines, so the ring is
# faster for small payloads and direct reads for large ones; from this size on a direct read
# also spares the actor its copy into the ring (docs/transports.md has the measurements).
MIN_BYTES = 4 * 1024 * 1024
_IOV_MAX = 1024
_NONCE_BYTES = 16


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None
if sys.platform.startswith("linux"):
    try:
        _readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
        _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                           ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
        _readv.restype = ctypes.c_ssize_t
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        _readv = None


def available() -> bool:
    return _readv is not None


def address(buf: Any) -> int:
    """The address of a contiguous buffer, read-only or not."""
    return np.frombuffer(buf, np.uint8).ctypes.data


def read(pid: int, remote: list[tuple[int, int]], local: list[memoryview]) -> None:
    """Copy the ``(address, length)`` pieces of process ``pid`` into ``local``, in order.
    Their total lengths must match. ``OSError`` (errno of the kernel) when it cannot."""
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available here")
    dst = [(address(v), len(v)) for v in local if len(v)]
    src = [(a, n) for a, n in remote if n]
    while src and dst:  # at most IOV_MAX pieces a side per call; the kernel stops at the shorter
        r, d = src[:_IOV_MAX], dst[:_IOV_MAX]
        got = _readv(pid, (_Iovec * len(d))(*d), len(d), (_Iovec * len(r))(*r), len(r), 0)  # type: ignore[misc]  # ctypes fills each _Iovec from an (address, length) tuple
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from process {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from process {pid} made no progress")
        src, dst = _advance(src, got), _advance(dst, got)


def _advance(pieces: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``pieces`` without their first ``n`` bytes."""
    i = 0
    while n and i < len(pieces):
        a, k = pieces[i]
        if n < k:
            return [(a + n, k - n)] + pieces[i + 1 :]
        n -= k
        i += 1
    return pieces[i:]


class Probe:
    """A random nonce at a fixed address of this process, for the learner to read back."""

    def __init__(self) -> None:
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self._buf = ctypes.create_string_buffer(self.nonce, _NONCE_BYTES)

    def describe(self) -> list[Any]:
        return [ctypes.addressof(self._buf), self.nonce]


def verify(pid: int, where: Any) -> None:
    """Read the actor's :class:`Probe` (``[address, nonce]``) out of process ``pid``;
    ``OSError`` unless it can be read and holds the nonce."""
    # Checked by type before use: bytes(n) of a hostile int n would allocate n bytes.
    if not isinstance(where, (list, tuple)) or len(where) != 2:
        raise OSError(errno.EINVAL, "malformed probe")
    address, nonce = where
    if type(address) is not int or not 0 < address < 1 << 64 or type(nonce) is not bytes or len(nonce) != _NONCE_BYTES:
        raise OSError(errno.EINVAL, "malformed probe")
    got = bytearray(_NONCE_BYTES)
    read(pid, [(int(address), _NONCE_BYTES)], [memoryview(got)])
    if bytes(got) != nonce:
        raise OSError(errno.EINVAL, f"process {pid} does not hold the announced nonce")


class Process:
    """One process, held by a pidfd so that its pid can never silently name another process:
    :meth:`read` fails once it has exited, even where the pid was reused before the read."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = os.pidfd_open(pid)  # OSError: no such process, or no pidfds here
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)  # readable once the process has exited

    def exited(self) -> bool:
        return self._fd is None or bool(self._poll.poll(0))

    def read(self, remote: list[tuple[int, int]], local: list[memoryview]) -> None:
        """:func:`read` from this process. Checked after the read: a process alive then held
        its pid all along, so the bytes are its own; otherwise ``ESRCH`` and they are void."""
        read(self.pid, remote, local)
        if self.exited():
            raise OSError(errno.ESRCH, f"process {self.pid} has exited")

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

"""Keyed tags of weights buckets: a universal hash with secret keys, finished by BLAKE2b.

A bucket is read as signed bytes in rows of :data:`ROW` bytes (the last row zero-padded; the
bucket's place and length go into its tag) and multiplied by a secret ``ROW x COLUMNS`` matrix
of random signed bytes: each row yields ``COLUMNS`` integer dot products, exact in int32
(at most 4096 * 128 * 128 = 2**26). For two rows that differ, one column's sums collide with
probability at most 2**-8 over its keys (take a byte that differs: at most one of the 256
values of its key cancels it), and the columns have independent keys, so all eight collide
with probability at most 2**-64. The row hashes never leave the process: a bucket's tag is
BLAKE2b, keyed with the version's secret, of its place and its row hashes. A forged bucket
therefore passes only if its row hashes collide with the real ones, or BLAKE2b is broken.

This is a matrix product of int8s, which CPUs with VNNI or AVX2 and GPUs do at memory speed:
about 1.1 ms per 16 MiB on one core, close to an unkeyed XXH3 checksum and far below keyed
BLAKE2b over the bytes themselves (docs/weights.md has the figures). The arithmetic is exact, so host and device
agree to the bit: a CUDA snapshot is tagged on its GPU (in float64, exact for these sums) and
only the row hashes (32 bytes per 4 KiB) come to the host.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import hmac
import os
import secrets
import struct
import sys
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..wire.keys import KEY_BYTES

__all__ = ["COLUMNS", "ROW", "VersionKey", "check_tags"]

ROW = 4096  # bytes per row: 4 KiB of weights per COLUMNS * 4 bytes of row hashes
COLUMNS = 8  # independent key columns: 2**-8 each
TAG_BYTES = 16
_CHUNK_ROWS = 2048  # rows per step: bounds the temporaries (8 MiB of bytes at a time)
_PLACE = struct.Struct("<QQQQ")


class VersionKey:
    """The secret of one model version: its key matrix (derived with SHAKE-256) and the BLAKE2b
    key of its tags. A fresh one is drawn for every published version."""

    __slots__ = ("_matrices", "rows", "secret")

    def __init__(self, secret: bytes | None = None):
        self.secret = secrets.token_bytes(KEY_BYTES) if secret is None else bytes(secret)
        if len(self.secret) != KEY_BYTES:
            raise ProtocolError(f"a weights key has {KEY_BYTES} bytes, not {len(self.secret)}")
        stream = hashlib.shake_256(b"rlink-v1 row keys|" + self.secret).digest(ROW * COLUMNS)
        self.rows = np.frombuffer(stream, dtype=np.int8).reshape(ROW, COLUMNS)
        self._matrices: dict[str, Any] = {}

    def tag(self, flat: Any, start: int, stop: int, version: int, index: int) -> bytes:
        """The tag of bucket ``index`` (bytes ``start:stop`` of ``flat``, a host ``np.uint8``
        array or a torch ``uint8`` tensor on any device) of ``version``."""
        return self.tag_of_rows(row_hashes(flat, start, stop, self), start, stop, version, index)

    def tag_of_rows(self, rows: bytes, start: int, stop: int, version: int, index: int) -> bytes:
        """The tag of bucket ``index`` (bytes ``start:stop``) of ``version`` from its row
        hashes, which may be computed piece by piece (:func:`row_hashes` of consecutive pieces
        of whole rows, joined, are those of the bucket)."""
        place = _PLACE.pack(version, index, start, stop)
        return hashlib.blake2b(place + rows, key=self.secret, digest_size=TAG_BYTES, person=b"rlink wtag").digest()

    def tags(self, flat: Any, buckets: list[tuple[int, int]], version: int) -> list[bytes]:
        return [self.tag(flat, a, b, version, i) for i, (a, b) in enumerate(buckets)]

    def matrix(self, device: Any, dtype: Any) -> Any:
        """The key matrix as a torch tensor of ``dtype`` on ``device`` (made once for each)."""
        import torch

        name = f"{device}/{dtype}"
        if name not in self._matrices:
            self._matrices[name] = torch.from_numpy(self.rows.copy()).to(device=device, dtype=dtype)
        return self._matrices[name]


def check_tags(expected: list[bytes], got: list[bytes], version: int) -> None:
    """Raise ProtocolError naming the buckets whose tags differ (compared in constant time)."""
    if len(expected) != len(got):
        raise ProtocolError(f"weights version {version}: {len(expected)} tags for {len(got)} buckets")
    bad = [i for i, (a, b) in enumerate(zip(expected, got)) if not hmac.compare_digest(a, b)]
    if bad:
        raise ProtocolError(f"weights version {version}: buckets {bad[:10]} failed their MAC (altered on the way)")


def row_hashes(flat: Any, start: int, stop: int, key: VersionKey, *, exact_float: bool = False) -> bytes:
    """Every row's ``COLUMNS`` dot products with the key matrix, as little-endian int32.
    ``exact_float``: compute in float64 (what a device does) instead of int8 products. Without
    torch (a numpy-only actor or learner) numpy computes the same sums (:func:`_rows_numpy`).
    A host array is hashed by torch only where the process has imported torch already: an
    actor that never touches torch must not pay its import (seconds, hundreds of MiB) here."""
    if isinstance(flat, np.ndarray) and "torch" not in sys.modules:
        return _rows_numpy(flat[start:stop].view(np.int8), key)
    import torch

    data = torch.from_numpy(flat[start:stop]) if isinstance(flat, np.ndarray) else flat[start:stop]
    data = data.view(torch.int8)
    if data.device.type == "cpu" and not exact_float and hasattr(torch, "_int_mm"):
        return _tag_worker().submit(_rows_int8, data, key).result()
    return _rows_float64(data, key)


_SEGMENTS = 4  # float32 sums of ROW / 4 int8 products stay below 2**24: exact


def _rows_numpy(data: np.ndarray, key: VersionKey) -> bytes:
    """The products of :func:`_rows_int8` with numpy: each row in ``_SEGMENTS`` parts whose
    float32 sums are exact integers, added in int32 (bit for bit what torch computes)."""
    full, rest = divmod(len(data), ROW)
    matrix = key.rows.astype(np.float32).reshape(_SEGMENTS, ROW // _SEGMENTS, COLUMNS)
    step = 256  # rows per matrix product: 4 MiB of float32 at a time
    blocks = [data[r * ROW : min(full, r + step) * ROW] for r in range(0, full, step)]
    if rest:  # the last row, zero-padded
        tail = np.zeros(ROW, dtype=np.int8)
        tail[:rest] = data[full * ROW :]
        blocks.append(tail)
    parts = []
    for block in blocks:
        rows = block.reshape(-1, _SEGMENTS, ROW // _SEGMENTS).astype(np.float32).transpose(1, 0, 2)
        parts.append(np.matmul(rows, matrix).astype(np.int32).sum(axis=0, dtype=np.int32))  # [row, column]
    return b"".join(p.astype("<i4", copy=False).tobytes() for p in parts)


def _rows_int8(data: Any, key: VersionKey) -> bytes:
    import torch

    full, rest = divmod(len(data), ROW)
    matrix = key.matrix("cpu", torch.int8)
    parts = [torch._int_mm(data[r * ROW : min(full, r + _CHUNK_ROWS) * ROW].view(-1, ROW), matrix)
             for r in range(0, full, _CHUNK_ROWS)]  # fmt: skip
    if rest:
        tail = torch.zeros(ROW, dtype=torch.int8)
        tail[:rest] = data[full * ROW :]
        parts.append(torch._int_mm(tail.view(1, ROW), matrix))
    return b"".join(p.numpy().astype("<i4", copy=False).tobytes() for p in parts)


def _rows_float64(data: Any, key: VersionKey) -> bytes:
    """The same products in float64: exact, since every partial sum is an integer below 2**27."""
    import torch

    full, rest = divmod(len(data), ROW)
    matrix = key.matrix(data.device, torch.float64)
    parts = [data[r * ROW : min(full, r + _CHUNK_ROWS) * ROW].view(-1, ROW).to(torch.float64) @ matrix
             for r in range(0, full, _CHUNK_ROWS)]  # fmt: skip
    if rest:
        tail = torch.zeros(ROW, dtype=torch.float64, device=data.device)
        tail[:rest] = data[full * ROW :].to(torch.float64)
        parts.append(tail.view(1, ROW) @ matrix)
    if not parts:
        return b""
    return torch.cat(parts).to(torch.int32).cpu().numpy().astype("<i4", copy=False).tobytes()


@functools.cache
def _tag_worker() -> concurrent.futures.ThreadPoolExecutor:
    """One thread that computes host tags, with one OpenMP thread. torch's int8 matrix product
    otherwise runs on every core, and on a host whose cores are all busy (a learner and its
    actors sharing a machine) threads waiting for each other make it up to 20x slower. The
    OpenMP setting is per thread: the caller's ``torch.get_num_threads()`` is left as it is."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlink-tags", initializer=_one_omp_thread)


os.register_at_fork(after_in_child=_tag_worker.cache_clear)  # a forked child has no such thread


def _one_omp_thread() -> None:
    import torch

    torch.get_num_threads()  # torch sets this thread's OpenMP thread count once, on first use
    library = _openmp_library()
    if library is not None:
        ctypes.CDLL(library).omp_set_num_threads(1)


def _openmp_library() -> str | None:
    """The OpenMP runtime torch loaded (libgomp, libiomp or libomp), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if path.startswith("/") and os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")):
                    return path
    except OSError:
        pass
    return None

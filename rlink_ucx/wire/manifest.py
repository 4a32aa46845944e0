"""The manifest of one model version: where each tensor lies in the flat weights buffer, split
into buckets (one collective each). A receiver validates it before allocating anything; the
buckets' keyed tags travel apart, in a Seal (``wire/keys.py``, ``weights/mac.py``)."""

from __future__ import annotations

import math

import msgspec

from ..errors import ProtocolError
from .codec import DTYPES, MAX_DIMS, MAX_NAME_LEN

__all__ = ["ALIGN", "KEYED", "Entry", "Manifest"]

ALIGN = 64
KEYED = "keyed-v1"  # the bucket check: a keyed tag per bucket, sent in a Seal (weights/mac.py)
MAX_BUCKETS = 1 << 16  # a manifest cannot make a receiver build a huge bucket list


class Entry(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int

    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


class Manifest(msgspec.Struct, array_like=True, frozen=True):
    """Where every tensor of one version lives in the flat buffer, and how its buckets are checked."""

    version: int
    entries: list[Entry]
    total_bytes: int
    bucket_bytes: int
    checksums: list[int]  # always empty: the keyed tags of the buckets follow in a Seal message
    checksum: str  # the bucket check: KEYED (unkeyed checksums are refused)

    def buckets(self) -> list[tuple[int, int]]:
        """``(start, stop)`` byte ranges, one per collective."""
        step = self.bucket_bytes
        return [(start, min(start + step, self.total_bytes)) for start in range(0, self.total_bytes, step)]

    def validate(self, *, max_bytes: int, max_entries: int) -> None:
        """Reject a manifest that could make the receiver over-allocate or read out of bounds."""
        if not 0 <= self.total_bytes <= max_bytes:
            raise ProtocolError(f"weights of {self.total_bytes} bytes exceed max_weights_bytes={max_bytes}")
        if self.bucket_bytes < ALIGN or self.bucket_bytes % ALIGN or self.version <= 0:
            raise ProtocolError("weights manifest has a bad bucket size or version")
        n_buckets = -(-self.total_bytes // self.bucket_bytes)  # counted, not listed: no allocation yet
        if n_buckets > MAX_BUCKETS:
            raise ProtocolError(f"weights manifest splits into {n_buckets} buckets; limit {MAX_BUCKETS}")
        if len(self.entries) > max_entries:
            raise ProtocolError(f"weights manifest lists {len(self.entries)} tensors; limit {max_entries}")
        if self.checksum != KEYED or self.checksums:
            raise ProtocolError(f"weights manifest with checksums {self.checksum[:20]!r}: only {KEYED!r} is accepted")
        names = set()
        for e in self.entries:
            if e.dtype not in DTYPES or not 0 < len(e.name) <= 4 * MAX_NAME_LEN or e.name in names:
                raise ProtocolError(f"weights entry {e.name[:60]!r}: bad or duplicate name, or dtype {e.dtype!r}")
            if len(e.shape) > MAX_DIMS or any(d < 0 or d > 2**40 for d in e.shape):
                raise ProtocolError(f"weights entry {e.name[:60]!r}: bad shape {e.shape[:MAX_DIMS + 1]}")
            if e.offset < 0 or e.offset % ALIGN or e.offset + e.nbytes() > self.total_bytes:
                raise ProtocolError(f"weights entry {e.name[:60]!r} lies outside the buffer")
            names.add(e.name)

    def describe(self) -> str:
        return f"version {self.version}: {len(self.entries)} tensors, {self.total_bytes} bytes"

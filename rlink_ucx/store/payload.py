"""A whole frame's payload in hand, checked and copied into the receive ring's chunks
(``StepRing.land``): one buffer of every field's bytes, one field after another (what a tcp
read brings), or one buffer per field."""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError

__all__ = ["copy_whole", "fields_of", "slices"]


def fields_of(payload: memoryview | list[memoryview], n: int, sizes: list[int]) -> list[memoryview] | None:
    """Each field's bytes of a frame of ``n`` steps when ``payload`` is a list of buffers (one
    per field is used as it is); None when it is one buffer of every field, one after another
    (its size checked), which ``copy_whole`` copies from directly."""
    if isinstance(payload, list):
        if len(payload) == len(sizes) and all(len(p) == n * sb for p, sb in zip(payload, sizes)):
            return payload
        payload = memoryview(b"".join(payload))
        if len(payload) == n * sum(sizes):
            return slices(payload, n, sizes)
    if len(payload) != n * sum(sizes):
        raise ProtocolError(f"a frame of {n} steps with {len(payload)} bytes of payload")
    return None


def slices(payload: memoryview, n: int, sizes: list[int]) -> list[memoryview]:
    """Each field's bytes in ``payload`` (every field's, one after another)."""
    parts, pos = [], 0
    for sb in sizes:
        parts.append(payload[pos : pos + n * sb])
        pos += n * sb
    return parts


def copy_whole(arrays: list[np.ndarray], sizes: list[int], offset: int, n: int, payload: memoryview) -> None:
    """A frame's payload (every field's bytes, one after another) into one chunk's ``arrays``
    at step ``offset``: the common case, no list of per-field views made."""
    pos = 0
    for array, sb in zip(arrays, sizes):
        array.data[offset * sb : (offset + n) * sb] = payload[pos : pos + n * sb]
        pos += n * sb

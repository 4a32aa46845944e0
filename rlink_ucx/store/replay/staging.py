"""Host staging buffers a sample copies rows into, and the pool that reuses them.

A set is reused only once no batch refers to it: torch tensors and numpy views made from its
buffers keep them referenced, and a CUDA copy to the device must have finished.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ...wire.frameworks import aligned
from .table import ReplayTable

__all__ = ["Draw", "Staging", "StagingPool"]

_POOL = 4  # staging sets kept for reuse


class Staging:
    """Host buffers for one batch; torch tensors made from them keep them referenced."""

    def __init__(self, table: ReplayTable, rows: int, batch_size: int, pin: bool, fields: bool = True):
        self.rows = rows
        self.claimed = False  # handed to a sample that has not made its tensors yet
        self.fields = [_empty((rows, spec.step_bytes), np.uint8, pin) for spec in table.schema.fields] if fields else []
        self.slots = _empty((rows,), np.int64, pin)  # slot numbers, for a device gather's index
        self.meta = _empty((4, rows), np.int64, pin)
        self.index = _empty((batch_size,), np.int64, pin)
        self.weight = _empty((batch_size,), np.float32, pin)
        self.copied: Any = None  # the CUDA event of the copy to the device

    def in_use(self) -> bool:
        """Whether a sample or a batch still refers to these buffers."""
        if self.claimed or (self.copied is not None and not self.copied.query()):
            return True
        # 4 = this object's slot, the tuple, the loop variable and getrefcount's argument.
        return any(sys.getrefcount(a) > 4 for a in (*self.fields, self.slots, self.meta, self.index, self.weight))


class StagingPool:
    """Staging sets kept for reuse, up to ``size`` of them (callers guard it with the replay's lock)."""

    def __init__(self, size: int = _POOL):
        self.size = size
        self._sets: list[Staging] = []

    def reserve(self, size: int) -> None:
        """Keep at least ``size`` sets (more while sampling ahead: each batch ahead holds one)."""
        self.size = max(self.size, size)

    def take(self, table: ReplayTable, rows: int, batch_size: int, pin: bool, fields: bool) -> Staging:
        """A free set for ``rows`` rows, claimed: a kept one if one is free, else a new one.
        ``fields``: whether it has buffers for the rows' bytes (a CUDA gather makes its own)."""
        for staging in self._sets:
            if staging.rows == rows and not staging.in_use():
                staging.claimed = True
                return staging
        staging = Staging(table, rows, batch_size, pin, fields)
        staging.claimed = True
        if len(self._sets) < self.size:
            self._sets.append(staging)
        return staging


class Draw:
    """A batch being made: its table, staging and item count; the storage rows still to copy
    (host tables) or the gathered tensors (device tables)."""

    def __init__(self, table: ReplayTable, staging: Staging, items: int):
        self.table = table
        self.staging = staging
        self.items = items
        self.rows: np.ndarray | None = None
        self.tensors: list[Any] = []


def _empty(shape: tuple[int, ...], dtype: Any, pin: bool) -> np.ndarray:
    if pin:
        import torch

        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        pinned: np.ndarray = torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy().view(dtype).reshape(shape)
        return pinned
    return aligned(shape, dtype)

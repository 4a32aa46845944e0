"""A host replay table that takes whole ring chunks without copying them (see ``blocks.py``).

Same ids, slots, metadata and samplers as :class:`ReplayTable`; only where a step's bytes sit
differs: the storage holds ``blocks`` blocks of ``block`` rows (one ring chunk each, a few
more than the capacity needs), and ``BlockMap.phys`` maps each slot to its row. Inserting a
chunk the ring received into one of this table's blocks maps its steps to that block; any
other steps are copied into rows taken in order from a block being filled.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..._memory import populate
from ...wire.codec import Schema
from .blocks import KEEP_FREE, BlockMap
from .storage import discard
from .table import ReplayTable, _alloc

__all__ = ["BlockTable", "spare_blocks"]


def spare_blocks(ring_steps: int, block: int) -> int:
    """Blocks beyond the capacity's: the ring's chunks, the few kept free, and the partly held
    blocks at both ends of the held ids and of the block being filled."""
    return -(-ring_steps // block) + KEEP_FREE + 4


class BlockTable(ReplayTable):
    def __init__(self, schema: Schema, capacity: int, sequence_length: int | None = None, *, block: int,
                 spare: int, touch: bool = True):  # fmt: skip
        self.block = block
        self.map = BlockMap(capacity, block, -(-capacity // block) + spare)
        self.adopted = 0  # steps inserted without a copy
        self.copied = 0  # steps inserted by copying
        super().__init__(schema, capacity, sequence_length, pin=False, touch=touch)
        self._bases = [rows.ctypes.data for rows in self.rows]
        # The ring keeps the blocks lent to it after this table is gone, and with them (numpy
        # views) the whole storage: give everything else back to the system then.
        weakref.finalize(self, _forget_unlent, list(self.rows), self.map.lent, block)

    def _make_rows(self, pin: bool, touch: bool) -> list[Any]:
        n = self.map.blocks * self.block
        rows = [_alloc(n * f.step_bytes, pin, touch).reshape(n, f.step_bytes) for f in self.schema.fields]
        if not touch:  # a load fills the capacity's rows; the blocks beyond are the ring's to receive into
            for storage in rows:
                threading.Thread(target=populate, args=(storage[self.capacity :].reshape(-1),), daemon=True,
                                 name="rlink-replay-populate").start()  # fmt: skip
        return rows

    # --- inserting ------------------------------------------------------------------------------------
    def evict_for(self, n: int) -> range:
        gone = super().evict_for(n)
        self.map.evict(np.arange(gone.start, gone.stop, dtype=np.int64) % self.capacity)
        return gone

    def owned_block(self, chunk: list[np.ndarray]) -> int | None:
        """The lent block whose rows ``chunk`` (per stored field, flat) are, or None."""
        size = self.block * self.rows[0].shape[1]
        b, off = divmod(chunk[0].ctypes.data - self._bases[0], size)
        if off or b not in self.map.lent:
            return None
        for arr, base, rows in zip(chunk, self._bases, self.rows):
            if arr.ctypes.data != base + b * self.block * rows.shape[1] or arr.nbytes != self.block * rows.shape[1]:
                return None
        return int(b)

    def place(self, start_id: int, groups: list[tuple[int, int | None]]) -> list[list[tuple[int, int]]]:
        """Rows for the steps from ``start_id`` in ``groups`` of ``(count, adopted block or
        None)``, in order (lock held): an adopted block's steps are in place already (no runs),
        the others get ``(row, count)`` runs to copy into."""
        out: list[list[tuple[int, int]]] = []
        at = start_id
        for count, block in groups:
            slots = np.arange(at, at + count, dtype=np.int64) % self.capacity
            if block is not None:
                self.map.adopt(block, slots)
                out.append([])
                self.adopted += count
            else:
                out.append(self.map.allocate(slots))
                self.copied += count
            at += count
        return out

    def copy_in(self, runs: list[tuple[int, int]], sources: list[list[np.ndarray]]) -> None:
        """Copy steps into the rows ``runs``: per field, their bytes as consecutive arrays."""
        for rows, parts in zip(self.rows, sources):
            flat = rows.reshape(-1)
            sb = rows.shape[1]
            src = iter(parts)
            part, used = next(src), 0
            for row, k in runs:
                at, end = row * sb, (row + k) * sb
                while at < end:
                    if used == part.size:
                        part, used = next(src), 0
                    m = min(end - at, part.size - used)
                    flat[at : at + m] = part[used : used + m]
                    at, used = at + m, used + m

    def lend_block(self) -> int | None:
        """A free block for the ring to receive into (lock held), or None."""
        return self.map.lend()

    def block_views(self, block: int) -> list[np.ndarray]:
        """Per stored field, the block's rows as one flat array (a ring chunk's layout)."""
        lo, hi = block * self.block, (block + 1) * self.block
        return [rows[lo:hi].reshape(-1) for rows in self.rows]

    # --- reading ----------------------------------------------------------------------------------
    def storage_rows(self, ids: np.ndarray) -> np.ndarray:
        return self.map.rows(self.slots(ids).ravel())

    # --- checkpoints ------------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        held = [np.arange(s, s + k, dtype=np.int64) for s, k in self.id_order_runs()]
        self.map.restore(np.concatenate(held) if held else np.zeros(0, dtype=np.int64))

    def chunks(self, field: int, runs: list[tuple[int, int]], size: int) -> Iterator[np.ndarray]:
        for s, k in runs:
            for row, n in self.map.runs_in_order(np.arange(s, s + k, dtype=np.int64)):
                flat = self.rows[field][row : row + n].reshape(-1)  # a view: never a copy of the table
                for lo in range(0, flat.size, size):
                    yield flat[lo : lo + size]


def _forget_unlent(rows: list[np.ndarray], lent: set[int], block: int) -> None:
    """Discard every block's pages but those of the ``lent`` blocks (the ring still has them)."""
    blocks = rows[0].shape[0] // block
    keep = sorted(lent) + [blocks]
    lo = 0
    for b in keep:
        if b > lo:
            for storage in rows:
                discard(storage[lo * block : b * block])
        lo = b + 1

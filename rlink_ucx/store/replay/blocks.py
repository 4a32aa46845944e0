"""Where each step of a host table lives: rows of storage allocated in blocks of ring chunks.

A replay that copies each step from the learner's receive ring into its table makes three
copies of every step on the learner's machine (actor -> shared memory -> ring -> table) where
``RLinkDataset`` makes two (it lends whole ring chunks out as batches). For large steps the
machine's memory bandwidth is the limit (docs/replay.md), so the table takes whole ring chunks
*without* copying them: its storage is made of blocks of ``block`` rows, one ring chunk each;
it gives free blocks to the ring as receive buffers (``StepRing.lend_chunk(replacement=)``),
and when such a block comes back full of steps it becomes those steps' rows as it is.

So a step's row is no longer its slot: ``phys[slot]`` says where it is. Steps inserted by
copying (a chunk that is not whole, or not one of ours) get rows from a block being filled in
order. A block is free again once none of its rows holds a step (``used`` counts them), then
it may be given to the ring. A loaded table starts with every step at the row of its slot.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BlockMap"]

KEEP_FREE = 4  # free blocks never given to the ring: inserts that copy always find rows


class BlockMap:
    def __init__(self, capacity: int, block: int, blocks: int):
        if blocks * block < capacity + KEEP_FREE * block:
            raise ValueError("a block map needs room beyond the capacity")
        self.block = block
        self.blocks = blocks
        self.phys = np.arange(capacity, dtype=np.int64)  # the row of each slot
        self.used = np.zeros(blocks, dtype=np.int64)  # rows of each block that hold a step
        self.free = list(range(blocks - 1, -1, -1))  # a stack: low blocks first
        self.lent: set[int] = set()  # blocks the ring receives into now
        self.fill = -1  # the block inserts that copy fill, in order
        self.fill_at = 0  # its next row

    def restore(self, slots: np.ndarray) -> None:
        """The held ``slots`` (a load) sit at the rows of their slots; nothing is lent."""
        self.phys = np.arange(self.phys.size, dtype=np.int64)
        self.used = np.bincount(slots // self.block, minlength=self.blocks).astype(np.int64)
        self.free = [int(b) for b in np.flatnonzero(self.used == 0)[::-1]]
        self.lent.clear()
        self.fill, self.fill_at = -1, 0

    def rows(self, slots: np.ndarray) -> np.ndarray:
        rows: np.ndarray = self.phys[slots]
        return rows

    def evict(self, slots: np.ndarray) -> None:
        """The steps in ``slots`` are gone: their rows are free; so is a block left empty."""
        if not slots.size:
            return
        blocks, counts = np.unique(self.phys[slots] // self.block, return_counts=True)
        self.used[blocks] -= counts
        for b in blocks[self.used[blocks] == 0].tolist():
            if b != self.fill:
                self.free.append(b)

    def allocate(self, slots: np.ndarray) -> list[tuple[int, int]]:
        """Rows for steps to copy into ``slots`` (in order): returns them as ``(row, count)``
        runs of consecutive rows."""
        runs: list[tuple[int, int]] = []
        at = 0
        while at < slots.size:
            if self.fill < 0 or self.fill_at == self.block:
                self._next_fill()
            k = min(slots.size - at, self.block - self.fill_at)
            row = self.fill * self.block + self.fill_at
            self.phys[slots[at : at + k]] = np.arange(row, row + k)
            self.used[self.fill] += k
            self.fill_at += k
            runs.append((row, k))
            at += k
        return runs

    def _next_fill(self) -> None:
        old = self.fill
        if not self.free:  # cannot happen while KEEP_FREE holds (see lend): say so plainly
            raise RuntimeError("replay table: no free block left for inserts")
        self.fill, self.fill_at = self.free.pop(), 0
        if old >= 0 and self.used[old] == 0:  # all of its steps were evicted while it filled
            self.free.append(old)

    def lend(self) -> int | None:
        """A free block to give the ring as a receive chunk, or None (keep copying)."""
        if len(self.free) <= KEEP_FREE:
            return None
        b = self.free.pop()
        self.lent.add(b)
        return b

    def adopt(self, block: int, slots: np.ndarray) -> None:
        """A lent block came back full: its rows become those of ``slots`` (``block`` steps)."""
        self.lent.discard(block)
        self.phys[slots] = np.arange(block * self.block, (block + 1) * self.block)
        self.used[block] = self.block

    def runs_in_order(self, slots: np.ndarray) -> list[tuple[int, int]]:
        """The rows of ``slots`` (in order) as ``(row, count)`` runs of consecutive rows."""
        if not slots.size:
            return []
        rows = self.phys[slots]
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [rows.size]])
        return [(int(rows[s]), int(e - s)) for s, e in zip(starts, ends)]

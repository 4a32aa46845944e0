"""The replay table: ``capacity`` steps in preallocated per-field storage, oldest evicted first.

Every inserted step gets an *id* from an insertion counter (never reused); it lives in slot
``id % capacity`` until ``capacity`` later steps evict it, so the held ids are always the
range ``[inserted - held, inserted)``. Each field is one flat byte array viewed as
``[capacity, step_bytes]`` rows, so a batch is one ``np.take`` per field whatever the dtype
(bfloat16 included); its rows are reinterpreted as the field's dtype and shape by torch.

Per slot the table also keeps the step's actor, sequence number and behaviour version, and,
for windows of ``T`` steps, ``prev`` (the id of the same actor's previous step when its
sequence number is exactly one less) and ``back`` (the id ``T - 1`` steps back along those
links, or -1): a window ending at id ``e`` is whole iff ``back[e]`` is still held.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ...wire.codec import Schema
from .split_gather import gather_rows
from .storage import host_storage, populate_all, populated

__all__ = ["ReplayTable"]

PRIORITY_FIELD = "_priority"  # the reserved field an actor adds for put(..., priority=p)


class ReplayTable:
    on_device = False  # the rows are numpy arrays in host memory (DeviceTable: torch tensors)

    def __init__(self, schema: Schema, capacity: int, sequence_length: int | None = None, *, pin: bool = False,
                 touch: bool = True):  # fmt: skip
        self.schema = schema  # the stored fields (without the priority field)
        self.capacity = capacity
        self.window = sequence_length or 1
        self.rows: list[Any] = self._make_rows(pin, touch)  # per field: [capacity, step_bytes] uint8
        meta = np.zeros((5, capacity), dtype=np.int64)  # pages touched now, not at the first insert
        self.actor_id, self.seq, self.version, self.prev, self.back = meta
        self.prev[:] = -1
        self.back[:] = -1
        self.inserted = 0  # the next id
        self.held = 0
        self._chains: dict[int, tuple[int, np.ndarray]] = {}  # actor -> (last seq, last T ids)

    def _make_rows(self, pin: bool, touch: bool) -> list[Any]:
        return [_alloc(self.capacity * f.step_bytes, pin, touch).reshape(self.capacity, f.step_bytes)
                for f in self.schema.fields]  # fmt: skip

    @property
    def first(self) -> int:
        """The oldest held id."""
        return self.inserted - self.held

    def slots(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) % self.capacity

    def is_held(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        return (ids >= self.first) & (ids < self.inserted)

    # --- inserting: reserve (under the caller's lock), write (outside it), publish (under it)
    def evict_for(self, n: int) -> range:
        """Forget the oldest steps so ``n`` more fit; returns the evicted ids."""
        drop = max(0, self.held + n - self.capacity)
        gone = range(self.first, self.first + drop)
        self.held -= drop
        return gone

    def write(self, start_id: int, fields: list[np.ndarray], count: int) -> None:
        """Copy ``count`` steps (per field: raw bytes, ``count * step_bytes``) to ids from ``start_id``."""
        for rows, data in zip(self.rows, fields):
            for slot, lo, k in self._runs(start_id, count):
                rows[slot : slot + k].reshape(-1)[:] = data[lo * rows.shape[1] : (lo + k) * rows.shape[1]]

    def finish_writes(self) -> None:
        """Wait for the copies ``write`` started (the source bytes may be reused afterwards)."""

    def _runs(self, start_id: int, count: int) -> list[tuple[int, int, int]]:
        slot = start_id % self.capacity
        first = min(count, self.capacity - slot)
        return [(slot, 0, first)] + ([(0, first, count - first)] if count > first else [])

    def describe(self, start_id: int, count: int, actor_id: int, seq: int, version: int) -> None:
        """Record the metadata and sequence links of ``count`` steps of one actor's stream."""
        ids = np.arange(start_id, start_id + count, dtype=np.int64)
        slots = ids % self.capacity
        self.actor_id[slots] = actor_id
        self.seq[slots] = np.arange(seq, seq + count)
        self.version[slots] = version
        last_seq, history = self._chains.get(actor_id, (None, None))
        if last_seq != seq - 1 or history is None:  # a gap (or a new actor): a new chain
            history = np.full(self.window, -1, dtype=np.int64)
        chain = np.concatenate([history, ids])
        self.prev[slots] = chain[self.window - 1 : -1]
        self.back[slots] = chain[1 : count + 1] if self.window > 1 else ids
        self._chains[actor_id] = (seq + count - 1, chain[-self.window :])

    def publish(self, count: int) -> None:
        self.inserted += count
        self.held += count

    # --- reading ------------------------------------------------------------------------------
    def whole_windows(self, ends: np.ndarray) -> np.ndarray:
        """Which window-end ids have all ``T`` steps still held."""
        back = self.back[self.slots(ends)]
        whole: np.ndarray = (back >= self.first) & self.is_held(ends)
        return whole

    def window_ids(self, ends: np.ndarray) -> np.ndarray:
        """``[B, T]`` ids of the windows ending at ``ends`` (whole ones: see whole_windows)."""
        out = np.empty((len(ends), self.window), dtype=np.int64)
        out[:, -1] = ends
        for t in range(self.window - 1, 0, -1):
            out[:, t - 1] = self.prev[out[:, t] % self.capacity]
        return out

    def gather(self, ids: np.ndarray, outs: list[np.ndarray]) -> None:
        """Copy the rows of ``ids`` (any shape) into ``outs`` (per field ``[ids.size, step_bytes]``)."""
        # np.take with mode="clip", large batches split with a helper thread (split_gather.py)
        gather_rows(list(zip(self.rows, outs)), self.storage_rows(ids))

    def storage_rows(self, ids: np.ndarray) -> np.ndarray:
        """The storage rows of ``ids`` (flattened). Under the replay's lock: an insert may move
        them; the rows of held ids stay valid until those ids are evicted."""
        return (np.asarray(ids, dtype=np.int64) % self.capacity).ravel()

    def meta(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        slots = np.asarray(ids, dtype=np.int64) % self.capacity
        return self.version[slots], self.actor_id[slots], self.seq[slots]

    # --- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"inserted": self.inserted, "held": self.held,
                "chains": [[a, s, h.tolist()] for a, (s, h) in self._chains.items()]}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        self.inserted, self.held = int(state["inserted"]), int(state["held"])
        self._chains = {int(a): (int(s), np.asarray(h, dtype=np.int64)) for a, s, h in state["chains"]}

    def id_order_runs(self) -> list[tuple[int, int]]:
        """The held slots as at most two ``(slot, count)`` runs, oldest first."""
        return [(s, k) for s, _, k in self._runs(self.first, self.held)] if self.held else []

    def chunks(self, field: int, runs: list[tuple[int, int]], size: int) -> Iterator[np.ndarray]:
        """The bytes of ``field`` in the slot ``runs``, in order, as host arrays of at most
        ``size`` bytes; each is valid until the next is asked for."""
        for s, k in runs:
            flat = self.rows[field][s : s + k].reshape(-1)  # a view: never a copy of the table
            for lo in range(0, flat.size, size):
                yield flat[lo : lo + size]

    def sinks(self, field: int, runs: list[tuple[int, int]], size: int) -> Iterator[np.ndarray]:
        """Host arrays of at most ``size`` bytes to fill, in order, with the bytes of ``field``
        in the slot ``runs``; each is stored once the next is asked for (or the loop ends).
        Each lies in memory with the guard space of ``storage.py`` around it (direct reads)."""
        yield from populated(list(self.chunks(field, runs, size)))  # host rows: the chunks are the storage itself


def _alloc(nbytes: int, pin: bool, touch: bool) -> np.ndarray:
    # A table a load fills gets small pages: see host_storage.
    out = host_storage(nbytes, pin=pin, huge=touch)
    if touch and not pin:  # every page now: the first inserts should not pay the page faults (a load fills them anyway)
        populate_all(out)
    return out

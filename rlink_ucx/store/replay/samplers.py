"""How a replay table hands out items: uniform, prioritized (sum tree) or FIFO.

An *item* is a step, or with ``sequence_length = T`` a window of ``T`` consecutive steps of one
actor named by the id of its last step. Samplers return item ids (the table's insertion
counter, never reused) and importance weights; the caller holds the replay's lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ConfigError
from .sumtree import SumTree
from .table import ReplayTable

__all__ = ["FifoSampler", "PrioritizedSampler", "UniformSampler", "make_sampler"]

_REDRAWS = 16  # rejection rounds for windows before listing the whole ones


class UniformSampler:
    """Every held item equally likely, with replacement."""

    name = "uniform"

    def __init__(self, table: ReplayTable, rng: np.random.Generator):
        self.table = table
        self.rng = rng

    def on_insert(self, ids: np.ndarray, priorities: np.ndarray | None) -> None:
        pass

    def on_evict(self, ids: range) -> None:
        pass

    def insert_room(self) -> int | None:
        return None

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``n`` item ids and their weights, or None when no whole item is held."""
        t = self.table
        if not t.held:
            return None
        ids = self.rng.integers(t.first, t.inserted, n)
        kept = self._whole(ids) if t.window > 1 else ids
        return None if kept is None else (kept, np.ones(n, dtype=np.float32))

    def _whole(self, ids: np.ndarray) -> np.ndarray | None:
        # Rejection: a uniform draw among held ids, kept when its window is whole, is a
        # uniform draw among the whole windows.
        t = self.table
        for _ in range(_REDRAWS):
            bad = ~t.whole_windows(ids)
            if not bad.any():
                return ids
            ids[bad] = self.rng.integers(t.first, t.inserted, int(bad.sum()))
        held = np.arange(t.first, t.inserted)
        whole = held[t.whole_windows(held)]
        return self.rng.choice(whole, len(ids)) if whole.size else None

    def update(self, ids: np.ndarray, priorities: np.ndarray) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any], leaves: np.ndarray | None) -> None:
        pass


class PrioritizedSampler(UniformSampler):
    """P(i) proportional to ``priority_i ** alpha``; new items get the highest priority seen."""

    name = "prioritized"

    def __init__(self, table: ReplayTable, rng: np.random.Generator, alpha: float, beta: float):
        super().__init__(table, rng)
        self.alpha = alpha
        self.beta = beta
        self.tree = SumTree(table.capacity)
        self.max_priority = 1.0

    def on_insert(self, ids: np.ndarray, priorities: np.ndarray | None) -> None:
        if priorities is None:
            p = np.full(len(ids), self.max_priority)
        else:
            # An actor's NaN, infinite or negative priority cannot be refused (the step is
            # already here): such a step gets the highest priority seen, like one without.
            p = np.asarray(priorities, dtype=np.float64).reshape(-1)
            ok = np.isfinite(p) & (p >= 0)
            if ok.any():
                self.max_priority = max(self.max_priority, float(p[ok].max()))
            p = np.where(ok, p, self.max_priority)
        leaves = p**self.alpha
        if self.table.window > 1:  # a window that will never be whole is never drawn
            leaves[self.table.back[self.table.slots(ids)] < 0] = 0.0
        self.tree.set(self.table.slots(ids), leaves)

    def on_evict(self, ids: range) -> None:
        if len(ids):
            self.tree.set(self.table.slots(np.arange(ids.start, ids.stop)), np.zeros(len(ids)))

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        t = self.table
        if not t.held:
            return None
        if self.tree.total <= 0:  # every priority is zero: nothing to prefer
            return super().sample(n)
        for _ in range(_REDRAWS):
            ids = self._ids(self.tree.sample(self.rng, n))
            bad = ~t.whole_windows(ids) if t.window > 1 else np.zeros(n, dtype=bool)
            if not bad.any():
                return ids, self._weights(ids)
            # A window whose first step was evicted stays broken: drop its weight for good.
            # Drawing again is rejection sampling, so the law among whole windows is unchanged.
            self.tree.set(t.slots(ids[bad]), np.zeros(int(bad.sum())))
            if self.tree.total <= 0:
                return None
        return None

    def _ids(self, slots: np.ndarray) -> np.ndarray:
        t = self.table
        return t.first + (slots - t.first) % t.capacity

    def _weights(self, ids: np.ndarray) -> np.ndarray:
        # (N * P(i)) ** -beta, normalized by the batch's max: N and the total cancel out.
        p = self.tree.get(self.table.slots(ids))
        w = np.power(p / p.min(), -self.beta) if p.min() > 0 else np.ones(len(ids))
        weights: np.ndarray = (w / w.max()).astype(np.float32)
        return weights

    def update(self, ids: np.ndarray, priorities: np.ndarray) -> None:
        t = self.table
        keep = t.is_held(ids)
        if t.window > 1:
            keep &= t.whole_windows(ids)
        ids, priorities = ids[keep], priorities[keep]
        if ids.size:
            self.max_priority = max(self.max_priority, float(priorities.max()))
            self.tree.set(t.slots(ids), priorities.astype(np.float64) ** self.alpha)

    def leaves(self) -> np.ndarray:
        return self.tree.tree[self.tree.size : self.tree.size + self.table.capacity]

    def state(self) -> dict[str, Any]:
        return {"max_priority": self.max_priority}

    def restore(self, state: dict[str, Any], leaves: np.ndarray | None) -> None:
        self.max_priority = float(state["max_priority"])
        if leaves is not None:
            slots = np.concatenate([np.arange(s, s + k) for s, k in self.table.id_order_runs()] or [np.zeros(0, int)])
            self.tree.set(slots, leaves)


class FifoSampler(UniformSampler):
    """Each step once, oldest first (like ``RLinkDataset``); never evicts an unread step."""

    name = "fifo"

    def __init__(self, table: ReplayTable, rng: np.random.Generator):
        super().__init__(table, rng)
        self.cursor = 0  # the next id to hand out

    def insert_room(self) -> int | None:
        return self.table.capacity - (self.table.inserted - self.cursor)

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        t = self.table
        start = max(self.cursor, t.first)
        if t.inserted - start < n:
            return None
        self.cursor = start + n
        return np.arange(start, start + n, dtype=np.int64), np.ones(n, dtype=np.float32)

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def restore(self, state: dict[str, Any], leaves: np.ndarray | None) -> None:
        self.cursor = int(state["cursor"])


def make_sampler(kind: str, table: ReplayTable, rng: np.random.Generator, alpha: float, beta: float) -> UniformSampler:
    if kind == "uniform":
        return UniformSampler(table, rng)
    if kind == "prioritized":
        return PrioritizedSampler(table, rng, alpha, beta)
    if kind == "fifo":
        return FifoSampler(table, rng)
    raise ConfigError(f'sampler must be "uniform", "prioritized" or "fifo", got {kind!r}')


def _checked(priorities: Any, n: int) -> np.ndarray:
    """Priorities as float64, refusing a wrong length, NaN, infinity or a negative value."""
    p = np.asarray(priorities, dtype=np.float64).reshape(-1)
    if p.size != n:
        raise ConfigError(f"got {p.size} priorities for {n} items")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ConfigError("priorities must be finite and >= 0 (got NaN, infinity or a negative value)")
    return p

"""Plain counters behind the learner's metrics: fixed-bucket histograms filled a batch at a
time, and per-actor totals that survive session ends with a bounded set of actor labels.

Nothing here imports ``prometheus_client``: the exporter (``learner_metrics``) reads these at
scrape time, so the data path only ever adds to a few integers.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

# Seconds: from half a millisecond (a batch waiting in the ring for one linger) to 10 s (a
# consumer far behind its actors).
LATENCY_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PUBLISH_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STALENESS_BOUNDS = (0, 1, 2, 3, 4, 8, 16, 32, 64, 128)  # policy versions

# Actors that get series of their own; later ones are summed under actor="other". The first
# ones seen keep their label for good, so every series (and "other") only ever goes up.
MAX_ACTOR_SERIES = 64
PER_ACTOR = ("frames", "steps", "bytes")
TOTALS = ("frames", "steps", "bytes", "duplicate_steps", "lost_steps", "protocol_errors", "credit_exhausted")
_VECTOR_FROM = 16  # pieces per batch from which numpy beats a loop (its fixed cost is ~5 us)


class Buckets:
    """A histogram with fixed upper bounds (Prometheus ``le`` semantics: a value counts in the
    first bucket whose bound it does not exceed). Thread safe."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(float(b) for b in bounds)
        self._edges = np.asarray(self.bounds, dtype=np.float64)
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, weight: int = 1) -> None:
        """Count ``weight`` observations of ``value``."""
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += weight
            self._sum += value * weight

    def observe_pairs(self, pairs: Iterable[tuple[float, int]]) -> None:
        """Count ``weight`` observations of ``value`` for each ``(value, weight)`` (a loop: for a few)."""
        bounds, counts, where = self.bounds, self._counts, bisect.bisect_left
        total = 0.0
        with self._lock:
            for value, weight in pairs:
                counts[where(bounds, value)] += weight
                total += value * weight
            self._sum += total

    def observe_many(self, values: np.ndarray, weights: np.ndarray) -> None:
        """Count ``weights[i]`` observations of ``values[i]``, vectorized (numpy's fixed cost,
        about 5 us, beats a Python loop from a few dozen values on)."""
        idx = np.searchsorted(self._edges, values, side="left")
        add = np.bincount(idx, weights=weights, minlength=len(self._counts)).astype(np.int64).tolist()
        total = float(np.dot(values, weights))
        with self._lock:
            for i, n in enumerate(add):
                self._counts[i] += n
            self._sum += total

    def read(self) -> tuple[list[int], float]:
        """Cumulative counts, one per bound plus the last for ``+Inf`` (every observation), and
        the sum of the values."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        return list(itertools.accumulate(counts)), total


def cumulative(bounds: Sequence[float], counts: dict[int, int]) -> tuple[list[int], float]:
    """What :meth:`Buckets.read` returns, for a ``{value: count}`` histogram (staleness)."""
    per = [0] * (len(bounds) + 1)
    total = 0.0
    for value, n in counts.items():
        per[bisect.bisect_left(bounds, value)] += n
        total += value * n
    return list(itertools.accumulate(per)), total


class FetchTimings:
    """Histograms fed by the dataset and ``publish`` while metrics are on (any thread)."""

    def __init__(self) -> None:
        self.latency = Buckets(LATENCY_BOUNDS)  # per step: landed in the ring -> handed out
        self.put_latency = Buckets(LATENCY_BOUNDS)  # per step: put on the actor -> handed out
        self.fetch = Buckets(LATENCY_BOUNDS)  # per batch: how long fetch() took, waiting included
        self.publish = Buckets(PUBLISH_BOUNDS)  # per publish() call

    def record_fetch(self, pieces: Sequence[Any], started: float, now: float, wall_now: float) -> None:
        """A batch of ``pieces`` (ring pieces with ``count``, ``ready_at`` and ``put_at``) was
        handed out at ``now`` by a fetch that began at ``started`` (``time.monotonic()`` both);
        ``wall_now`` is ``time.time()`` then. Put times come from the actors' clocks: across
        hosts the put->fetch figure is only as good as their clock sync (a put time ahead of
        ours counts as 0)."""
        n = len(pieces)
        if n > _VECTOR_FROM:  # a batch of many small frames: one numpy pass
            ready = np.fromiter((p.ready_at for p in pieces), dtype=np.float64, count=n)
            put = np.fromiter((p.put_at for p in pieces), dtype=np.float64, count=n)
            counts = np.fromiter((p.count for p in pieces), dtype=np.float64, count=n)
            self.latency.observe_many(np.maximum(now - ready, 0.0), counts)
            known = put > 0
            self.put_latency.observe_many(np.maximum(wall_now - put[known], 0.0), counts[known])
        else:  # a few pieces (the frames of a batch): a fraction of a microsecond each
            self.latency.observe_pairs((max(now - p.ready_at, 0.0), p.count) for p in pieces)
            self.put_latency.observe_pairs((max(wall_now - p.put_at, 0.0), p.count) for p in pieces if p.put_at > 0)
        self.fetch.observe(now - started)


class ActorTotals:
    """Counters of sessions that ended, so totals never go down when an actor leaves or
    reconnects (a new session starts its own counters). Used on the I/O loop only."""

    def __init__(self, max_series: int = MAX_ACTOR_SERIES):
        self.max_series = max_series
        self._labelled: set[int] = set()
        self._ended: dict[str, dict[str, int]] = {}  # label -> PER_ACTOR counters of ended sessions
        self._ended_total = dict.fromkeys(TOTALS, 0)
        self.reconnects = 0  # sessions that resumed a stream an earlier session had started
        self.lost_sessions = 0  # sessions that ended without a goodbye

    def label(self, actor_id: int) -> str:
        """The ``actor`` label of ``actor_id``: its own for the first ``max_series`` actors seen."""
        if actor_id in self._labelled:
            return str(actor_id)
        if len(self._labelled) < self.max_series:
            self._labelled.add(actor_id)
            return str(actor_id)
        return "other"

    def ended(self, actor_id: int, stats: Any, lost: bool) -> None:
        """A session ended with ``stats`` (its ``SessionStats``, final: no frame commits after)."""
        row = self._ended.setdefault(self.label(actor_id), dict.fromkeys(PER_ACTOR, 0))
        for name in PER_ACTOR:
            row[name] += getattr(stats, name)
        for name in TOTALS:
            self._ended_total[name] += getattr(stats, name, 0)
        self.lost_sessions += lost

    def read(self, sessions: Iterable[tuple[int, Any]]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """Per-label and total counters: the ended sessions' plus ``sessions`` (``(actor_id,
        stats)`` of the open ones)."""
        per = {label: dict(row) for label, row in self._ended.items()}
        total = dict(self._ended_total)
        for actor_id, stats in sessions:
            row = per.setdefault(self.label(actor_id), dict.fromkeys(PER_ACTOR, 0))
            for name in PER_ACTOR:
                row[name] += getattr(stats, name)
            for name in TOTALS:
                total[name] += getattr(stats, name, 0)
        return per, total

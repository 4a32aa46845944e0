"""What ``learner.stats()`` reports: per-actor and total counters, the buffer, the weights
fan-out, and the staleness of fetched steps."""

from __future__ import annotations

import os
from typing import Any

from .._version import __version__


class StalenessHistogram:
    """Fetched steps by staleness (the learner's version at fetch minus the step's version).

    Counted exactly up to ``CAP`` either way and at ``+-CAP`` beyond, so an actor that gives
    every frame a version of its own cannot grow the learner's memory or its stats; the mean
    and the max stay exact."""

    CAP = 1024

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._steps = 0
        self._total = 0
        self._max: int | None = None

    def record(self, counts: dict[int, int]) -> None:
        """Add a batch's counts (called by the dataset, under its lock)."""
        for staleness, n in counts.items():
            key = max(-self.CAP, min(self.CAP, staleness))
            self.counts[key] = self.counts.get(key, 0) + n
            self._steps += n
            self._total += staleness * n
            self._max = staleness if self._max is None else max(self._max, staleness)

    def summary(self, dropped: int) -> dict[str, Any]:
        return {
            "histogram": dict(sorted(self.counts.items())),
            "mean": self._total / self._steps if self._steps else 0.0,
            "max": self._max if self._max is not None else 0,
            "dropped": dropped,
        }


def report(server: Any) -> dict[str, Any]:
    """The learner's stats (on the I/O loop): ``server`` is its ``LearnerServer``."""
    ring = server.ring
    actors = [describe_session(s) for s in server.sessions.values()]
    total = {k: sum(a[k] + 0 for a in actors + server.ended)
             for k in ("frames", "steps", "bytes", "torn_frames", "duplicate_steps", "lost_steps")}  # fmt: skip
    return {
        "address": f"{server.host}:{server.port}",
        "version": server.version,
        "pid": os.getpid(),
        "library": __version__,
        "schema": server.schema.describe() if server.schema else None,
        "actors": actors,
        "ended_actors": list(server.ended),
        "connected_actors": len(actors),
        "lost_actors": sum(1 for a in server.ended if a["state"] == "lost"),
        "rejected_connections": server.admission.rejected,
        "handshakes_in_flight": server.admission.in_flight,
        "shed_handshakes": server.admission.shed,  # unauthenticated, dropped by either cap
        "shed_handshakes_per_peer": server.admission.shed_per_peer,  # ... of which by max_handshakes_per_peer
        "preauth_timeouts": server.admission.timed_out,  # no login within preauth_timeout
        "auth_failures": server.admission.auth_failures,
        **server.planes.counters(),  # e.g. ucx_workers_recycled
        "buffer": {
            "capacity_bytes": ring.capacity * ring.step_bytes if ring else 0,
            "buffered_bytes": ring.buffered_bytes if ring else 0,
            "peak_buffered_bytes": ring.stats.peak_used * ring.step_bytes if ring else 0,
            "ready_steps": ring.ready_steps() if ring else 0,
            "steps_in": ring.stats.steps_in if ring else 0,
            "steps_out": ring.stats.steps_out if ring else 0,
            "torn_frames": ring.stats.torn_frames if ring else 0,
        },
        "total": total,
        "weights": server.publisher.snapshot_stats(),
        "staleness": server.staleness.summary(ring.stats.stale_dropped if ring else 0),
        **ranks(server),
    }


def ranks(server: Any) -> dict[str, Any]:
    """This learner's place in a job of many (rank 0 of 1 alone): rank 0 also lists every
    rank with its address and the actors placed on it; another rank, whether it is linked."""
    out: dict[str, Any] = {"rank": server.rank, "world_size": server.world}
    if server.ranks is not None:
        out["ranks"] = server.ranks.describe()
        out["redirected_actors"] = server.ranks.redirected
        out["moved_actors"] = server.ranks.moved
    if server.rank_link is not None:
        out["linked_to_rank_0"] = server.rank_link.linked.is_set()
    return out


def describe_session(session: Any) -> dict[str, Any]:
    """One actor's row of ``stats()["actors"]``."""
    return {
        "actor_id": session.actor_id,
        "incarnation": session.incarnation,
        "host": session.hello.host,
        "pid": session.hello.pid,
        "transport": session.transport,
        "transport_reason": session.transport_reason,
        "state": session.state.value,
        "error": session.error,
        "frames": session.stats.frames,
        "steps": session.stats.steps,
        "bytes": session.stats.bytes,
        "torn_frames": session.stats.torn_frames,
        "duplicate_steps": session.stats.duplicate_steps,
        "lost_steps": session.stats.lost_steps,
        "protocol_errors": session.stats.protocol_errors,
        "credit": session.flow.credit,
        "next_seq": session.next_seq,
        "subscribed": session.weights.subscribed,
        "weights_version": session.weights.acked,
    }

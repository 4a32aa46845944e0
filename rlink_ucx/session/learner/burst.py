"""A pump's burst of whole small frames from many sessions, landed at once (``land_burst``).

A tcp pump reads every connection that is ready before it lands anything, then hands the
whole frames it read to :func:`land_burst`: each is checked against its session (one hold of
that session's lock), then all of one ring's are copied and committed in one hold of the
ring's lock, and each session's wake-up check runs once for the burst, not once per frame.
A frame that fails ends only its own session: the frames of that session after it in the
burst are skipped (they would follow a frame that never landed), every other frame lands.
"""

from __future__ import annotations

from typing import Protocol

from ...store.ring import StepRing
from ...wire.frame import FrameHeader

__all__ = ["BurstSink", "land_burst"]


class BurstSink(Protocol):
    """What :func:`land_burst` needs of a session (``LearnerSession``)."""

    actor_id: int

    def admit_landing(self, header: memoryview, payload_bytes: int) -> tuple[FrameHeader, StepRing] | None: ...

    def after_landing(self) -> None: ...


def land_burst(frames: list[tuple[BurstSink, memoryview, memoryview]]) -> list[tuple[BurstSink, Exception]]:
    """Land whole frames ``(session, header, payload)`` in the order given (each session's in
    the order it sent them); returns each session that failed, with its first error."""
    failed: dict[BurstSink, Exception] = {}
    by_ring: dict[StepRing, tuple[list[tuple[int, int, int, int, float, memoryview]], list[BurstSink]]] = {}
    for session, header, payload in frames:
        if session in failed:
            continue
        try:
            admitted = session.admit_landing(header, len(payload))
        except Exception as exc:  # noqa: BLE001 - a ProtocolError, or a bug: either ends this session only
            failed[session] = exc
            continue
        if admitted is not None:  # None: a duplicate, counted and dropped
            h, ring = admitted
            items, owners = by_ring.setdefault(ring, ([], []))
            items.append((h.n_steps, session.actor_id, h.seq, h.version, h.put_time_us * 1e-6, payload))
            owners.append(session)
    for ring, (items, owners) in by_ring.items():
        for i, refused in ring.land_many(items):
            failed.setdefault(owners[i], refused)
    for session in dict.fromkeys(s for _, owners in by_ring.values() for s in owners):
        if session not in failed:
            session.after_landing()
    return list(failed.items())

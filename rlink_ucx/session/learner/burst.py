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


_Item = tuple[int, int, int, int, float, memoryview]  # what StepRing.land_many takes for a frame


def land_burst(frames: list[tuple[BurstSink, memoryview, memoryview]]) -> list[tuple[BurstSink, Exception]]:
    """Land whole frames ``(session, header, payload)`` in the order given (each session's in
    the order it sent them); returns each session that failed, with its first error."""
    failed: dict[BurstSink, Exception] = {}
    rings: dict[StepRing, tuple[list[_Item], list[BurstSink]]] = {}
    ring: StepRing | None = None  # the last frame's ring, and its lists (one ring, in practice)
    items: list[_Item] = []
    owners: list[BurstSink] = []
    for session, header, payload in frames:
        if failed and session in failed:
            continue
        try:
            admitted = session.admit_landing(header, len(payload))
        except Exception as exc:  # noqa: BLE001 - a ProtocolError, or a bug: either ends this session only
            failed[session] = exc
            continue
        if admitted is None:  # a duplicate, counted and dropped
            continue
        h, its_ring = admitted
        if its_ring is not ring:
            ring = its_ring
            items, owners = rings.setdefault(ring, ([], []))
        items.append((h.n_steps, session.actor_id, h.seq, h.version, h.put_time_us * 1e-6, payload))
        owners.append(session)
    for one_ring, (its_items, its_owners) in rings.items():
        for i, refused in one_ring.land_many(its_items):
            failed.setdefault(its_owners[i], refused)
    for session in {s: None for _, its_owners in rings.values() for s in its_owners}:  # each once, in order
        if session not in failed:
            session.after_landing()
    return list(failed.items())

"""A pump's burst of whole small frames from many sessions, landed at once (``land_burst``).

A tcp pump reads every connection that is ready before it lands anything, then hands the
whole frames it read to :func:`land_burst`. In a lockstep burst of hundreds of actors each
session brings one small frame, and checking and landing each one in the interpreter was
most of the learner's CPU per frame (docs/benchmarks.md, "#51"). So the burst lands in
*blocks* first (:func:`_land_blocks`): every header is checked as one numpy array against
what its session expects (``LearnerSession.lane``, with the sessions' locks held), and the
frames that pass, grouped by their number of steps, each land with one claim of ring space
and one copy per field (``StepRing.land_block``); each session then counts its frame.

Everything else takes the one-by-one path, which gives each refusal its precise error: a
session with several frames in the burst, a frame that fails any check (a duplicate after a
reconnect, a bad seq, another actor's id, a truncated payload ...), a resumed stream's first
frame, a frame too large to copy once more, a ring whose free space is not one run. Each
frame there is checked against its session (one hold of that session's lock), then all of one
ring's are copied and committed in one hold of the ring's lock. A frame that fails ends only
its own session: its later frames in the burst are skipped (they would follow a frame that
never landed), every other frame lands. Each session's wake-up check runs once per burst.
"""

from __future__ import annotations

import operator
import threading
import time
from typing import Protocol

import numpy as np

from ...errors import Closed
from ...store.ring import StepRing
from ...wire.frame import FRAME_MAGIC, FrameHeader, unpack_many
from ...wire.messages import PROTOCOL_VERSION

__all__ = ["BLOCK_MAX_PAYLOAD", "BLOCK_MIN", "BurstSink", "land_burst"]

BLOCK_MIN = 8  # frames a burst needs before it lands in blocks (a few cost more as arrays)
BLOCK_MAX_PAYLOAD = 4096  # bytes: a larger frame lands alone (a block copies each payload once more)
_SEQ_LIMIT = np.uint64(1 << 63)  # seqs are int64 in a batch (Batch.seq)
_NO_LANE = (-1, -1, -1, -1, -1)
_session_of = operator.itemgetter(0)  # a frame's session


class BurstSink(Protocol):
    """What :func:`land_burst` needs of a session (``LearnerSession``)."""

    actor_id: int
    incarnation: int
    lock: threading.Lock

    def lane(self) -> tuple[int, int, int, int, int, StepRing] | None: ...

    def count_landed(self, n_steps: int, payload_bytes: int, now: float) -> bool: ...

    def admit_landing(self, header: memoryview, payload_bytes: int) -> tuple[FrameHeader, StepRing] | None: ...

    def after_landing(self) -> None: ...


_Frame = tuple[BurstSink, memoryview, memoryview]
_Item = tuple[int, int, int, int, float, memoryview]  # what StepRing.land_many takes for a frame


def land_burst(frames: list[_Frame]) -> list[tuple[BurstSink, Exception]]:
    """Land whole frames ``(session, header, payload)`` in the order given (each session's in
    the order it sent them); returns each session that failed, with its first error."""
    failed: dict[BurstSink, Exception] = {}
    if len(frames) >= BLOCK_MIN:
        frames = _land_blocks(frames, failed)
    if frames:
        _land_each(frames, failed)
    return list(failed.items())


def _land_blocks(frames: list[_Frame], failed: dict[BurstSink, Exception]) -> list[_Frame]:
    """Land what can land in blocks; returns the frames left for :func:`_land_each`."""
    large = {session for session, _, payload in frames if len(payload) > BLOCK_MAX_PAYLOAD}
    picked = [f for f in frames if f[0] not in large] if large else frames
    if len(picked) < BLOCK_MIN:
        return frames
    sessions = list(dict.fromkeys(map(_session_of, picked)))  # each once, in order
    landed: set[BurstSink] = set()
    wake: list[BurstSink] = []
    for session in sessions:  # only a pump takes several sessions' locks, and each session is one pump's
        session.lock.acquire()
    try:
        for group, records, ring, n_steps in _blocks(picked, sessions):
            batch = [picked[i] for i in group]
            try:
                done = _land_block(batch, records, ring, n_steps, wake)
            except Closed as exc:  # the learner is closing: these sessions end, as one by one
                failed.update((session, exc) for session, _, _ in batch)
                done = True
            if done:
                landed.update(map(_session_of, batch))
    finally:
        for session in sessions:
            session.lock.release()
    for session in dict.fromkeys(wake):
        session.after_landing()
    return [f for f in frames if f[0] not in landed] if landed else frames


def _blocks(picked: list[_Frame], sessions: list[BurstSink]) -> list[tuple[list[int], np.ndarray, StepRing, int]]:
    """The frames of ``picked`` that pass every check, as blocks of one ring and one number of
    steps: their indexes, their headers (records of ``HEADER_DTYPE``), the ring and the number
    of steps. A session whose frames do not all pass, or differ in their number of steps, has
    none in a block. The sessions' locks are held."""
    lanes = [session.lane() for session in sessions]
    ring = next((lane[5] for lane in lanes if lane is not None), None)
    if ring is None:
        return []
    index = {session: i for i, session in enumerate(sessions)}
    at = np.array([index[frame[0]] for frame in picked])  # each frame's session
    # Each session's schema id, seq, credit, actor id and incarnation, as each of its frames
    # must carry them (-1s: none of its frames may land in a block). One flat list of ints:
    # numpy takes it several times faster than a list of tuples.
    flat: list[int] = []
    for lane in lanes:
        flat += lane[:5] if lane is not None and lane[5] is ring else _NO_LANE
    expect = np.array(flat, np.int64).reshape(-1, 5)[at]
    ids = expect[:, 3:].astype(np.uint64)  # ActorId: < 2**63; compared with the headers' u64 as u64
    h = unpack_many(b"".join(header for _, header, _ in picked))
    n = h["n_steps"].astype(np.int64)
    before = _steps_before(at, n) if len(sessions) < len(picked) else 0  # a session's earlier frames in the burst
    ok = (expect[:, 0] >= 0) & (h["magic"] == FRAME_MAGIC) & (h["proto"] == PROTOCOL_VERSION)
    ok &= (h["schema_id"].astype(np.int64) == expect[:, 0]) & (h["actor_id"] == ids[:, 0]) & (h["incarnation"] == ids[:, 1])
    ok &= (n > 0) & (n <= ring.max_frame_steps) & (before + n <= expect[:, 2])
    ok &= (h["seq"] < _SEQ_LIMIT - n.astype(np.uint64)) & (h["seq"].astype(np.int64) == expect[:, 1] + before)
    ok &= h["payload_bytes"] == (n * ring.schema.step_bytes).astype(np.uint64)
    ok &= h["payload_bytes"] == np.array([len(payload) for _, _, payload in picked], dtype=np.uint64)
    if len(sessions) < len(picked):  # all of a session's frames, or none: they land in order, in one block
        least, most = np.full(len(sessions), 1 << 40), np.zeros(len(sessions), np.int64)
        np.minimum.at(least, at, n)
        np.maximum.at(most, at, n)
        refused = least != most  # frames of different sizes: they would land in two blocks, out of order
        np.logical_or.at(refused, at, ~ok)
        ok &= ~refused[at]
    good = np.flatnonzero(ok)
    if len(good) < BLOCK_MIN:
        return []
    sizes = n[good]
    if sizes.min() == sizes.max():  # one block: every frame of one size (a lockstep burst)
        return [(good.tolist(), h[good], ring, int(sizes[0]))]
    return [(good[sizes == k].tolist(), h[good[sizes == k]], ring, int(k)) for k in np.unique(sizes)]


def _steps_before(at: np.ndarray, n: np.ndarray) -> np.ndarray:
    """For each frame, the steps of its session's frames before it in the burst (``at``: each
    frame's session; ``n``: its steps)."""
    order = np.argsort(at, kind="stable")  # each session's frames together, in burst order
    counts = n[order]
    ends = np.cumsum(counts)
    first = np.ones(len(order), bool)
    first[1:] = at[order][1:] != at[order][:-1]
    starts = np.maximum.accumulate(np.where(first, ends - counts, 0))  # where each frame's session begins
    out = np.empty_like(n)
    out[order] = ends - counts - starts
    return out


def _land_block(batch: list[_Frame], h: np.ndarray, ring: StepRing, n_steps: int, wake: list[BurstSink]) -> bool:
    """Land ``batch`` (frames that passed every check, ``n_steps`` each, their headers ``h``)
    in ``ring`` and count them; False, nothing landed or counted, where its free space is not
    one run."""
    payload = np.frombuffer(b"".join(payload for _, _, payload in batch), dtype=np.uint8).reshape(len(batch), -1)
    actors = [frame[0].actor_id for frame in batch]
    put_at = (h["put_time_us"] * 1e-6).tolist()
    if not ring.land_block(n_steps, actors, h["seq"].tolist(), h["version"].tolist(), put_at, payload):
        return False
    now = time.monotonic()
    size = payload.shape[1]
    for session, _, _ in batch:
        if session.count_landed(n_steps, size, now):
            wake.append(session)
    return True


def _land_each(frames: list[_Frame], failed: dict[BurstSink, Exception]) -> None:
    """The one-by-one path: each frame's checks, then one ``land_many`` per ring."""
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

"""The frame in progress on the learner (``Landing``): a plane that wants one buffer per field
(ucx) gets them in the scratch buffer when the frame's place in the ring crosses a chunk, and
the commit scatters them into the ring; a duplicate is received into scratch and dropped; a
torn frame gives its place back and frees the buffer."""

from __future__ import annotations

import numpy as np
import pytest

from rlink_ucx.session.learner.landing import Landing
from rlink_ucx.session.learner.session import LearnerSession
from rlink_ucx.store.ring import StepRing
from tests.unit.test_land import SCHEMA, STEP, _frame, _session, _steps, _taken

pytestmark = pytest.mark.timeout(60)


def _receive(session: LearnerSession, seq: int, n: int) -> list[int]:
    """One frame through begin, a copy per view and end; returns the views' sizes."""
    header, payload = _frame(seq, n)
    views = session.begin(header)
    at = 0
    for v in views:
        v[:] = payload[at : at + len(v)]
        at += len(v)
    assert at == len(payload)
    session.end_threadsafe()
    return [len(v) for v in views]


def test_a_whole_fields_frame_across_a_chunk_is_staged_and_scattered_on_commit():
    session, ring = _session(chunk_steps=4)
    session.whole_fields = True  # as the ucx plane asks
    assert _receive(session, 0, 3) == [3 * 16, 3 * 8, 3]  # fits one chunk: straight into the ring
    assert session._land.buffer is None
    assert _receive(session, 3, 3) == [3 * 16, 3 * 8, 3]  # one step in the first chunk, two in the next
    assert session._land.buffer is not None and len(session._land.buffer) == 3 * STEP
    assert session._land.scatter is None and session._land.frame is None
    got = _taken(ring, 6)
    want = _steps(0, 6)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert (session.flow.credit, session.next_seq, session.stats.frames) == (994, 6, 2)


def test_a_duplicate_through_begin_lands_in_scratch_and_never_in_the_ring():
    session, ring = _session()
    _receive(session, 0, 2)
    session.resumed, session.next_seq = True, 2
    assert _receive(session, 0, 2) == [2 * 16, 2 * 8, 2]  # resent after a reconnect
    assert (session.stats.duplicate_steps, session.stats.frames, ring.used, session.next_seq) == (2, 1, 2, 2)
    assert session.flow.credit == 996  # the duplicate's credit is spent too, as the actor spent it


def test_a_torn_frame_is_abandoned_and_its_buffer_freed():
    session, ring = _session(chunk_steps=4)
    session.whole_fields = True
    _receive(session, 0, 3)
    header, _ = _frame(3, 3)
    session.begin(header)  # crosses the chunk: staged
    assert session._land.frame is not None and session._land.scatter is not None
    session.abandon()
    assert (session._land.frame, session._land.buffer, session._land.scatter) == (None, None, None)
    assert (session.stats.torn_frames, ring.used, session.next_seq) == (1, 3, 3)


def test_landing_scratch_views_follow_the_schema_and_reuse_one_buffer():
    ring = StepRing(SCHEMA, 64 * STEP, 4, chunk_steps=8)
    landing = Landing()
    small = landing.scratch(2 * STEP, 2, ring)
    assert [len(v) for v in small] == [32, 16, 2]
    first = landing.buffer
    assert [len(v) for v in landing.scratch(STEP, 1, ring)] == [16, 8, 1]
    assert landing.buffer is first  # large enough already: not reallocated
    landing.scratch(4 * STEP, 4, ring)
    assert landing.buffer is not first and len(landing.buffer) == 4 * STEP
    assert landing.drop() is None and landing.buffer is None

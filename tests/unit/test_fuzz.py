"""Fuzzing the two parsers that face the network: data-frame headers and control messages.

Whatever the bytes, the result is an accepted frame that satisfies every limit, or
ProtocolError before anything is allocated; nothing else escapes and nothing is reserved.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlink_ucx import ProtocolError
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.frame import FRAME_HEADER, FRAME_HEADER_BYTES
from rlink_ucx.wire.manifest import Entry, Manifest
from tests.unit.test_validation import SCHEMA, make_session

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_begin(raw: bytes) -> None:
    session, ring = make_session(credit=50)
    try:
        views = session.begin(raw)
    except ProtocolError:
        assert ring.used == 0 and session.credit == 50, "a rejected header reserved something"
        return
    h = _wire.FrameHeader.unpack(raw)
    assert h.schema_id == 1 and h.actor_id == 7 and h.incarnation == 11, "accepted a frame of another session"
    assert 0 < h.n_steps <= 50 and h.payload_bytes == h.n_steps * SCHEMA.step_bytes
    assert sum(len(v) for v in views) == h.payload_bytes <= 50 * SCHEMA.step_bytes


@pytest.mark.timeout(120)
@FUZZ
@given(st.binary(min_size=0, max_size=2 * FRAME_HEADER_BYTES))
def test_random_bytes_as_a_frame_header(raw):
    check_begin(raw)


@pytest.mark.timeout(120)
@FUZZ
@given(
    magic=st.sampled_from([b"RLNK", b"RLNX", b"\x00\x00\x00\x00"]),
    proto=st.sampled_from([0, 1, 2, 0xFFFF]),
    schema_id=st.sampled_from([0, 1, 2, 2**32 - 1]),
    n_steps=st.one_of(st.integers(0, 100), st.sampled_from([2**31, 2**32 - 1])),
    actor=st.sampled_from([7, 8, 0, 2**64 - 1]),
    incarnation=st.sampled_from([11, 12, 0]),
    seq=st.one_of(st.integers(0, 5), st.sampled_from([2**63, 2**64 - 1])),
    version=st.integers(-(2**63), 2**63 - 1),
    payload=st.one_of(st.integers(0, 2000), st.sampled_from([2**40, 2**64 - 1])),
)
def test_structured_frame_headers_near_every_limit(magic, proto, schema_id, n_steps, actor, incarnation, seq,
                                                   version, payload):  # fmt: skip
    check_begin(FRAME_HEADER.pack(magic, proto, 0, schema_id, n_steps, actor, incarnation, seq, version, payload))


@pytest.mark.timeout(120)
@FUZZ
@given(st.binary(max_size=300))
def test_random_control_messages_decode_or_raise_protocol_error(body):
    try:
        msg = _wire.decode(body)
    except ProtocolError:
        return
    assert type(msg).__module__ == _wire.__name__  # only our own typed structs, never arbitrary objects


@pytest.mark.timeout(120)
@FUZZ
@given(
    total=st.integers(-1, 2**42),
    bucket=st.integers(-1, 2**30),
    dims=st.lists(st.integers(-2, 2**41), max_size=10),
    offset=st.integers(-64, 2**41),
    dtype=st.sampled_from(["float32", "int64", "object", "bfloat16", ""]),
    sums=st.integers(0, 3),
)
def test_weights_manifests_are_validated_before_allocation(total, bucket, dims, offset, dtype, sums):
    m = Manifest(1, [Entry("w", dtype, dims, offset)], total, bucket, [0] * sums, "xxh3")
    try:
        m.validate(max_bytes=1 << 30, max_entries=10)
    except ProtocolError:
        return
    e = m.entries[0]
    assert 0 <= m.total_bytes <= 1 << 30 and 0 <= e.offset and e.offset + e.nbytes() <= m.total_bytes


def test_length_prefix_over_the_cap_is_refused_before_reading_the_body():
    with pytest.raises(ProtocolError, match="exceeds"):
        _wire.check_length(struct.unpack("<I", b"\xff\xff\xff\xff")[0], 512)

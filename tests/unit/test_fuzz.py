"""Fuzzing what faces the network: data-frame headers, every control message type at every
stage of a connection (before authentication, after it, on an open session, as a data
connection's Attach), the size caps, and the shm data connection's records.

Whatever the bytes, the result is an accepted frame or message that satisfies every limit,
or a typed error (ProtocolError and its kin) before anything is allocated; nothing else
escapes, and every input stays within a tracemalloc peak and a time bound.
"""

from __future__ import annotations

import os
import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlink_ucx import ProtocolError
from rlink_ucx.transport.plane import decode_blob, encode_blob
from rlink_ucx.transport.shm.plane import AttachDetail, RingAnswer
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.frame import FRAME_HEADER, FRAME_HEADER_BYTES
from rlink_ucx.wire.manifest import KEYED, Entry, Manifest
from tests import fuzzing as fz
from tests.unit.test_validation import SCHEMA, make_session

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_begin(raw: bytes) -> None:
    session, ring = make_session(credit=50)
    try:
        views = session.begin(raw)
    except ProtocolError:
        assert ring.used == 0 and session.flow.credit == 50, "a rejected header reserved something"
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
    check_begin(FRAME_HEADER.pack(magic, proto, 0, schema_id, n_steps, actor, incarnation, seq, version, payload, 0))


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
    m = Manifest(1, [Entry("w", dtype, dims, offset)], total, bucket, [0] * sums, KEYED)
    try:
        m.validate(max_bytes=1 << 30, max_entries=10)
    except ProtocolError:
        return
    e = m.entries[0]
    assert 0 <= m.total_bytes <= 1 << 30 and 0 <= e.offset and e.offset + e.nbytes() <= m.total_bytes


def test_length_prefix_over_the_cap_is_refused_before_reading_the_body():
    with pytest.raises(ProtocolError, match="exceeds"):
        _wire.check_length(struct.unpack("<I", b"\xff\xff\xff\xff")[0], 512)


# --- every control message type, with hostile field values, at every stage of a connection ---
# tests/fuzzing.py builds the inputs and runs them on the learner's own code; bench/fuzz.py
# runs the same for as long as asked.
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TYPES = pytest.mark.parametrize("cls", fz.MESSAGE_TYPES, ids=lambda c: c.__name__)
# A decoded message may hold Python objects for every byte (a list of small ints: ~40 bytes
# each), so the bound grows with the input; a claimed length honoured would be far above it.
DECODE_PEAK = 1 << 20


@pytest.fixture(scope="module")
def lab():
    lab = fz.Lab()
    yield lab
    lab.close()


def test_the_fuzz_seeds_cover_every_message_type():
    assert {type(m) for m in fz.valid_examples()} == set(fz.MESSAGE_TYPES)


@pytest.mark.timeout(120)
@TYPES
@FEW
@given(rng=st.randoms(use_true_random=False))
def test_every_message_type_with_hostile_fields_decodes_to_a_typed_message_or_protocol_error(cls, rng):
    body = fz.hostile_body(rng, cls)
    try:
        msg = fz.bounded(_wire.decode, body, peak=DECODE_PEAK + 64 * len(body), seconds=2)
    except ProtocolError:
        return
    assert type(msg) in fz.MESSAGE_TYPES


@pytest.mark.parametrize("cls", fz.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_deep_nesting_length_claims_and_wrong_types_in_any_field_are_protocol_errors(cls):
    tag, *fields = fz._SEEDS[cls]
    hostile = [fz.deep(d) for d in (999, 1000, 5000, 50_000)] + list(fz.CLAIMS)
    hostile += [{"a": 1}, [[[]]], -1, 2**64 - 1, float("nan"), None, "x" * 600, b"\xff" * 600]
    for i in range(len(fields)):
        for value in hostile:
            body = msgspec.msgpack.encode([tag, *fields[:i], value, *fields[i + 1 :]])
            try:  # anything but a typed message or ProtocolError (RecursionError, ...) fails here
                msg = fz.bounded(_wire.decode, body, peak=DECODE_PEAK + 64 * len(body), seconds=2)
            except ProtocolError:
                continue
            assert type(msg) is cls


@pytest.mark.timeout(120)
@TYPES
@FEW
@given(rng=st.randoms(use_true_random=False))
def test_every_message_type_before_authentication_is_refused_typed_and_bounded(lab, cls, rng):
    raw = fz.framed(fz.hostile_body(rng, cls))
    got = fz.bounded(lab.preauth, fz.mutate(rng, raw) if rng.random() < 0.3 else raw, peak=1 << 20, seconds=5)
    # With a token, nothing sent before a valid proof opens a session, a weights stream or a data plane.
    assert got in ("ProtocolError", "AuthError", "PeerLost", "Refused"), got


@pytest.mark.timeout(120)
@TYPES
@FEW
@given(rng=st.randoms(use_true_random=False))
def test_every_message_type_after_authentication_in_place_of_hello_is_typed_and_bounded(lab, cls, rng):
    got = fz.bounded(lab.authenticated, fz.framed(fz.hostile_body(rng, cls)), peak=1 << 20, seconds=5)
    assert got in ("ProtocolError", "PeerLost", "Refused", "Busy", "Superseded") or (
        got == "session" and cls is _wire.Hello) or (got == "stats" and cls is _wire.StatsRequest), got  # fmt: skip


@pytest.mark.timeout(120)
@TYPES
@FEW
@given(rng=st.randoms(use_true_random=False))
def test_every_message_type_on_an_open_session_is_typed_and_bounded(lab, cls, rng):
    raw = fz.framed(fz.hostile_body(rng, cls)) + fz.framed(fz.hostile_body(rng, rng.choice(fz.SESSION_TYPES)))
    got = fz.bounded(lab.session, raw, peak=4 << 20, seconds=5)
    assert got in ("ProtocolError", "SchemaMismatch", "PeerLost") or (got == "closed" and _wire.Bye.__name__ in
                                                                      repr(raw)), got  # fmt: skip


@pytest.mark.timeout(120)
@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_an_attach_with_hostile_fields_and_a_valid_proof_is_typed_and_bounded(lab, rng):
    got = fz.bounded(lab.attach, fz.hostile_body(rng, _wire.Attach), peak=4 << 20, seconds=5)
    assert got in ("ProtocolError", "AuthError") or got.startswith("attached"), got


def test_an_attach_with_numbers_where_bytes_belong_allocates_nothing(lab):
    # bytes(n) of an int n allocates n zeroed bytes: an arena or probe "nonce" of 2**28 used to.
    for arena, probe in [([os.getpid(), 3, 2**28, 1 << 16], None), (None, [4096, 2**28]), ([os.getpid(), 3, b"", 2**28], [2**63, b"x" * 16])]:
        body = msgspec.msgpack.encode(_wire.Attach(_wire.PROTOCOL_VERSION, 1, b"", encode_blob(AttachDetail(True, arena, probe))))
        got = fz.bounded(lab.attach, body, peak=4 << 20, seconds=5)
        assert got == "attached (fuzz)", got  # the shm plane, nothing mapped or read directly


@pytest.mark.timeout(120)
def test_the_preauth_cap_refuses_a_claimed_length_before_reading_or_allocating_it(lab):
    for length in (lab.config.max_preauth_bytes + 1, 2**20, 2**31, 2**32 - 1):
        # Only the prefix is sent: a learner that waited for the body would see EOF instead.
        got = fz.bounded(lab.preauth, _wire.LENGTH.pack(length) + b"\x00" * 16, peak=256 << 10, seconds=5)
        assert got == "ProtocolError", (length, got)
    padded = _wire.Login(_wire.PROTOCOL_VERSION, bytes(32), b"m" * lab.config.max_preauth_bytes)
    assert fz.bounded(lab.preauth, fz.framed(msgspec.msgpack.encode(padded)), peak=256 << 10, seconds=5) == "ProtocolError"


@pytest.mark.timeout(120)
def test_the_session_cap_refuses_a_claimed_length_before_reading_or_allocating_it(lab):
    for length in (lab.config.max_control_bytes + 1, 2**31, 2**32 - 1):
        got = fz.bounded(lab.session, _wire.LENGTH.pack(length) + b"\x00" * 16, peak=256 << 10, seconds=5)
        assert got == "ProtocolError", (length, got)


@pytest.mark.timeout(120)
@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_shm_data_connection_records_parse_or_are_refused_bounded(rng):
    assert fz.bounded(fz.Lab.records, fz.hostile_records(rng), peak=256 << 10, seconds=2) in ("EOFError", "ProtocolError")


@pytest.mark.parametrize("field", [["x", [], [4]], ["x", {"a": 1}, []], [["x"], "float32", []], ["x", "float32", [[4]]],
                                   ["x", "float32", {"a": 1}], ["x", None, None]])  # fmt: skip
def test_a_schema_field_of_the_wrong_types_is_a_protocol_error(lab, field):
    body = msgspec.msgpack.encode(_wire.Propose([field]))
    assert fz.bounded(lab.session, fz.framed(body), peak=1 << 20, seconds=5) == "ProtocolError"


@pytest.mark.timeout(120)
@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_an_attach_with_a_hostile_plane_detail_is_typed_and_bounded(lab, rng):
    got = fz.bounded(lab.attach, fz.hostile_attach_detail(rng), peak=4 << 20, seconds=5)
    assert got == "ProtocolError" or got.startswith("attached"), got


@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_a_hostile_ring_answer_is_a_protocol_error_or_a_ring_answer(rng):
    blob = fz.hostile_blob(rng, RingAnswer(1, 3, bytes(16), 1 << 16))
    try:
        got = decode_blob(blob, RingAnswer, "shm ring answer")
    except ProtocolError as exc:
        assert "malformed shm ring answer" in str(exc)
    else:
        assert type(got.pid) is int and type(got.nonce) is bytes and type(got.size) is int


def test_plane_blobs_and_offers_over_their_caps_are_refused_by_the_wire():
    big = bytes(_wire.PLANE_BLOB_BYTES + 1)
    for msg in (_wire.Attach(_wire.PROTOCOL_VERSION, 1, b"", big),
                _wire.Hello(1, 0, "0", "tcp", False, "h", 1, {"tcp": big}),
                _wire.Hello(1, 0, "0", "tcp", False, "h", 1, {f"p{i}": b"" for i in range(33)}),
                _wire.Welcome(1, 2, 3, "shm", "why", b"t", 10, 1.0, 2.0, -1, big)):
        with pytest.raises(ProtocolError, match="malformed control message"):
            _wire.decode(msgspec.msgpack.encode(msg))
    ok = _wire.Hello(1, 0, "0", "tcp", False, "h", 1, {"tcp": b"", "shm": b""})
    assert _wire.decode(msgspec.msgpack.encode(ok)) == ok


def test_an_attach_detail_round_trips_and_a_bad_one_is_a_protocol_error():
    detail = AttachDetail(True, [1, 3, bytes(16), 4096], None)
    assert decode_blob(encode_blob(detail), AttachDetail, "shm attach detail") == detail
    for bad in (b"", b"\xc1", encode_blob(["yes", None, None]), encode_blob({"mapped": True})):
        with pytest.raises(ProtocolError, match="malformed shm attach detail"):
            decode_blob(bad, AttachDetail, "shm attach detail")

"""Header and message validation: bad input is a ProtocolError raised before any allocation."""

import logging
import struct
import types

import pytest

from rlink_ucx import Config, ConfigError, ProtocolError
from rlink_ucx.observe.ratelog import RateLimitedLog
from rlink_ucx.session.learner.session import LearnerSession
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire import auth as _auth
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.codec import Schema
from rlink_ucx.wire.frame import FRAME_HEADER, FrameHeader

SCHEMA = Schema.from_spec({"obs": ("float32", (4,)), "done": ("bool", ())})


class _Control:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)

    def close(self):
        pass


def make_session(credit=100):
    ring = StepRing(SCHEMA, 1 << 16, 64)
    server = types.SimpleNamespace(config=Config(), grant_credits=lambda: None, session_ended=lambda *a: None,
                                   quiet_log=RateLimitedLog(logging.getLogger("test")),
                                   token=None)
    hello = _wire.Hello(7, 11, "0", "tcp", False, "h", 1)
    session = LearnerSession(server, 1, _Control(), hello, 7, "tcp", "test", b"t" * 32)
    session.schema_id, session.ring, session.flow.credit = 1, ring, credit
    return session, ring


def header(**overrides):
    fields = dict(schema_id=1, n_steps=2, actor_id=7, incarnation=11, seq=0, version=0,
                  payload_bytes=2 * SCHEMA.step_bytes)  # fmt: skip
    fields.update(overrides)
    return FrameHeader(**fields).pack()


def test_valid_header_reserves_exactly_the_payload():
    session, ring = make_session()
    views = session.begin(header())
    assert [len(v) for v in views] == [2 * 16, 2 * 1]
    assert ring.used == 2


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\x00" * 10, "expected 64"),
        (FRAME_HEADER.pack(b"XXXX", 1, 0, 1, 2, 7, 11, 0, 0, 34, 0), "magic"),
        (FRAME_HEADER.pack(b"RLNK", 99, 0, 1, 2, 7, 11, 0, 0, 34, 0), "protocol version"),
        (header(schema_id=5), "schema id"),
        (header(actor_id=8), "claims actor"),
        (header(incarnation=12), "claims actor"),
        (header(n_steps=0, payload_bytes=0), "frame of 0 steps"),
        (header(n_steps=10**6, payload_bytes=10**6 * 17), "limit"),
        (header(payload_bytes=2**40), "does not match"),
        (header(seq=5), "expected 0"),
        (header(n_steps=60, payload_bytes=60 * 17), "credit"),
    ],
)
def test_bad_headers_are_rejected_before_allocation(raw, match):
    session, ring = make_session(credit=50)
    with pytest.raises(ProtocolError, match=match):
        session.begin(raw)
    assert ring.used == 0 and session.flow.credit == 50


def test_negotiation_absent_rejects_frames():
    session, ring = make_session()
    session.schema_id = None
    with pytest.raises(ProtocolError, match="did not negotiate"):
        session.begin(header())


def test_control_messages_roundtrip_and_reject_garbage():
    msg = _wire.Welcome(1, 2, 3, "tcp", "why", b"t", 10, 1.0, 2.0, -1)
    raw = _wire.encode(msg)
    (length,) = struct.unpack("<I", raw[:4])
    assert length == len(raw) - 4
    assert _wire.decode(raw[4:]) == msg
    for garbage in [b"\x00", b"\xff" * 20, b"\x93\xa5Nope!\x01\x02", _wire.encode(_wire.Heartbeat())[4:-1] + b"\xc1"]:
        with pytest.raises(ProtocolError):
            _wire.decode(garbage)
    with pytest.raises(ProtocolError, match="exceeds"):
        _wire.check_length(513, 512)


def test_pickle_payload_is_not_a_message(tmp_path):
    import pickle

    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    with pytest.raises(ProtocolError):
        _wire.decode(pickle.dumps(Evil()))
    assert not canary.exists()


def test_mutual_proofs_are_direction_bound():
    token, a, b = b"secret", _auth.new_nonce(), _auth.new_nonce()
    assert _auth.actor_proof(token, a, b) != _auth.learner_proof(token, a, b)
    assert _auth.actor_proof(token, a, b) != _auth.actor_proof(b"other", a, b)
    assert len(a) == 32 and a != b
    _auth.verify(_auth.actor_proof(token, a, b), _auth.actor_proof(token, a, b), "x")
    with pytest.raises(Exception, match="did not match"):
        _auth.verify(_auth.actor_proof(token, a, b), _auth.learner_proof(token, a, b), "x")


def test_a_config_built_in_code_still_takes_the_fields_it_was_not_given_from_the_environment(monkeypatch):
    # The docs promise it; Config(...) used to ignore RLINK_* altogether, so an operator's
    # RLINK_SHM_DIRECT_READ=0 was lost on every script that built its own Config.
    monkeypatch.setenv("RLINK_PUT_TIMEOUT", "7")
    monkeypatch.setenv("RLINK_SHM_DIRECT_READ", "0")
    assert Config().put_timeout == 7.0
    cfg = Config(frame_bytes=8192)
    assert (cfg.put_timeout, cfg.shm_direct_read, cfg.frame_bytes) == (7.0, False, 8192)
    assert Config(put_timeout=3).put_timeout == 3  # what the code says wins
    assert cfg.replace(buffer_bytes=1 << 20).put_timeout == 7.0  # replace keeps the rest
    assert cfg.replace(put_timeout=2).put_timeout == 2
    assert Config.from_env({}).put_timeout == 30.0  # an explicit environment, not the process's
    monkeypatch.setenv("RLINK_PUT_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="RLINK_PUT_TIMEOUT='soon' is not a float"):
        Config(frame_bytes=8192)


def test_config_precedence(monkeypatch):
    monkeypatch.setenv("RLINK_PUT_TIMEOUT", "3.5")
    monkeypatch.setenv("RLINK_BUFFER_BYTES", "1048576")
    cfg = Config.from_env(put_timeout=9.0)
    assert cfg.put_timeout == 9.0 and cfg.buffer_bytes == 1 << 20
    assert Config.from_env().put_timeout == 3.5
    with pytest.raises(Exception, match="must be > 0"):
        Config(put_timeout=0)

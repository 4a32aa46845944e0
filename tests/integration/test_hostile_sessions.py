"""Authenticated peers that say what a real actor never would: each is refused or has its
session ended, and an honest actor beside it keeps every step (found by a hostile-input audit)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rlink_ucx import Actor, Config, ConfigError, Learner, RLinkDataset
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.frame import FrameHeader
from tests.integration.hostile import RawActor

TOKEN = b"hostile-session-test-token-0123456789"


def _honest_steps_arrive(learner: Learner, n: int = 50) -> None:
    """An honest actor puts ``n`` int64 steps ``x``; every one is fetched, in order."""
    dataset = RLinkDataset(learner, batch_size=n)
    with Actor(learner.address, token=TOKEN, transport="tcp") as actor:
        actor.put_many({"x": np.arange(n, dtype=np.int64)})
        actor.flush(30)
        batch = dataset.fetch(timeout=30)
    assert batch["x"].tolist() == list(range(n))


def _reply_to_proposal(learner: Learner, fields: list) -> str:
    """Open a session by hand, propose ``fields``: the learner's answer, as text."""
    hostile = RawActor(learner.address, TOKEN)
    try:
        hostile.hello(pid=1, transport="tcp")
        hostile.send(hostile.control, _wire.Propose(fields))
        while True:
            msg = hostile.recv(hostile.control)
            if isinstance(msg, (_wire.Accept, _wire.Reject, _wire.Error)):
                return repr(msg)
    except (ConnectionError, OSError, EOFError) as exc:
        return repr(exc)
    finally:
        hostile.close()


@pytest.mark.timeout(60)
def test_a_refused_schema_does_not_become_the_learners_schema():
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        reply = _reply_to_proposal(learner, [["x", "uint8", [2**31, 2]]])
        assert reply.startswith("Reject(") and "over max_frame_bytes" in reply, reply
        _honest_steps_arrive(learner)  # it used to be refused: the 4 GiB schema had stuck


@pytest.mark.timeout(60)
def test_a_frame_whose_seq_passes_2_63_ends_its_session_and_the_others_keep_their_steps():
    # Batch.seq is int64: such a frame made fetch() raise OverflowError, losing the batch.
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        hostile = RawActor(learner.address, TOKEN)
        try:
            welcome = hostile.hello(pid=1, transport="tcp")
            data = hostile.attach()
            hostile.expect(_wire.Ready)
            accept = hostile.propose([["x", "int64", []]])
            hostile.expect(_wire.Credit)
            header = FrameHeader(accept.schema_id, 2, welcome.actor_id, 0, 2**63 - 1, 0, 16).pack()
            data.sendall(header + np.arange(2, dtype=np.int64).tobytes())
            with pytest.raises(ConnectionError, match=r"beyond 2\*\*63"):
                hostile.expect(_wire.Bye)
        finally:
            hostile.close()
        deadline = time.monotonic() + 10
        while not learner.stats()["ended_actors"] and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = learner.stats()["ended_actors"]
        assert ended and ended[0]["protocol_errors"] == 1, ended
        assert learner.stats()["buffer"]["steps_in"] == 0
        _honest_steps_arrive(learner)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("actor_id", [2**63, -1])
def test_an_actor_id_outside_int64_is_refused(actor_id: int):
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        hostile = RawActor(learner.address, TOKEN)
        try:
            with pytest.raises((ConnectionError, OSError, EOFError)):
                hostile.hello(pid=1, transport="tcp", actor_id=actor_id)
        finally:
            hostile.close()
        with pytest.raises(ConfigError, match=r"actor_id must be an int in \[0, 2\*\*63\)"):
            Actor(learner.address, token=TOKEN, actor_id=actor_id)
        _honest_steps_arrive(learner)


@pytest.mark.timeout(60)
def test_a_schema_whose_two_frames_do_not_fit_the_ring_is_refused():
    # One 6 MiB step under max_frame_bytes: the ring would have grown to three of them (and
    # spares), past the 8 MiB of buffer_bytes.
    config = Config(buffer_bytes=8 << 20)
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=config) as learner:
        reply = _reply_to_proposal(learner, [["x", "uint8", [6 << 20]]])
        assert reply.startswith("Reject("), reply
        assert "must hold two frames, 12582912 bytes, over buffer_bytes=8388608" in reply, reply
        assert learner.stats()["buffer"]["capacity_bytes"] == 0  # no ring was made
        _honest_steps_arrive(learner)


@pytest.mark.timeout(60)
def test_a_field_name_with_control_characters_is_refused():
    # It would have gone into the learner's log as it is: a newline and an escape sequence
    # forge a log line.
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        reply = _reply_to_proposal(learner, [["x\n\x1b[31mERROR forged", "int64", []]])
        assert "printable characters" in reply, reply
        _honest_steps_arrive(learner)

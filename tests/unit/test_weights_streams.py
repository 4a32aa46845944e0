"""The learner's weights streams without sockets: which it keeps open (``Streams._keeps``), and
when a version counts as sent (``Streams._push``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlink_ucx.transport.session_state import SessionState
from rlink_ucx.weights.membership import Membership, stalled
from rlink_ucx.weights.snapshot import BufferPool, snapshot
from rlink_ucx.weights.streams import _Stream


def stream_of(**session: object) -> _Stream:
    fields = {"subscribed": True, "state": SessionState.OPEN, "weights_shared": False, **session}
    weights = Membership(subscribed=bool(fields.pop("subscribed")), shared=bool(fields.pop("weights_shared")))
    return _Stream(SimpleNamespace(weights=weights, **fields), sock=None, key=b"", sent=0)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_stream_that_overtook_its_subscribe_is_kept_open(publisher):
    # The Subscribe travels on the control connection, the stream on its own: the learner may
    # read the stream's opening first. Ended after one version there, the stream left the
    # actor to open a second one.
    assert publisher.streams._keeps(stream_of(subscribed=False)) is True
    assert publisher.streams._keeps(stream_of()) is True


@pytest.mark.timeout(30)
def test_an_actor_reading_shared_memory_or_gone_gets_a_one_version_stream(publisher):
    assert publisher.streams._keeps(stream_of(weights_shared=True)) is False  # nothing published: shared by default
    assert publisher.streams._keeps(stream_of(state=SessionState.CLOSED)) is False
    # A version outside shared memory (a CUDA one) keeps even a sharing actor's stream.
    publisher.latest = SimpleNamespace(shared=None, version=1)
    assert publisher.streams._keeps(stream_of(weights_shared=True)) is True
    publisher.latest = SimpleNamespace(shared=np.zeros(1), version=1)
    assert publisher.streams._keeps(stream_of(weights_shared=True)) is False


class _StoppedPeer:
    """A socket whose peer stopped reading after ``room`` bytes: the next send raises, as a
    timed-out ``sendall`` to a SIGSTOPped actor does."""

    def __init__(self, room: int):
        self.room, self.taken = room, 0

    def sendall(self, data: bytes | memoryview) -> None:
        if self.taken + len(data) > self.room:
            raise TimeoutError("the peer stopped reading")
        self.taken += len(data)


@pytest.mark.timeout(30)
def test_an_actor_stopped_mid_version_was_sent_it_so_the_chain_can_splice_it_out(publisher):
    # Regression (a flaky relay test): ``sent`` was noted only after the Seal, so a chain head
    # stopped while taking a version by stream stayed "not behind" and starved its readers.
    snap = snapshot({"w": np.arange(20_000, dtype=np.float32)}, 7, 4096, BufferPool())
    stream = stream_of()
    stream.sock = _StoppedPeer(room=10_000)  # type: ignore[assignment]
    member = stream.session.weights
    member.sent = member.acked = 6
    with pytest.raises(TimeoutError):
        publisher.streams._push(stream, snap)
    assert member.sent == 7 and member.acked == 6 and stream.sent == 0  # sent from its first byte, not complete
    assert publisher.stats["streamed"] == 0  # a version counts as streamed only once whole
    stall = 5.0
    assert stalled(member, 100.0, stall) is False  # behind from now on
    assert stalled(member, 100.0 + stall, stall) is True  # and out of the chain once it confirms nothing

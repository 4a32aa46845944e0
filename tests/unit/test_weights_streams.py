"""Which weights streams the learner keeps open (``Publisher._keeps``), without sockets."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlink_ucx.transport.session_state import SessionState
from rlink_ucx.weights.membership import Membership
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

"""A session that has ended ignores late data-plane failures (no warning, no error sent)."""

import logging
from types import SimpleNamespace

import pytest

from rlink_ucx.errors import ProtocolError
from rlink_ucx.session.learner_session import LearnerSession
from rlink_ucx.wire import messages as _wire


class _Control:
    def __init__(self):
        self.sent, self.closed = [], False

    def send(self, msg):
        self.sent.append(msg)

    def close(self):
        self.closed = True


def _session(ended: list) -> tuple[LearnerSession, _Control]:
    server = SimpleNamespace(session_ended=lambda s, err: ended.append((s.state, err)), token=None)
    control = _Control()
    hello = _wire.Hello(7, 0, "test", "tcp", False, False, "host", 1)
    return LearnerSession(server, 1, control, hello, 7, "tcp", "test", b"t" * 32), control


@pytest.mark.timeout(10)
def test_a_protocol_error_ends_an_open_session_and_is_reported():
    ended: list = []
    session, control = _session(ended)
    session.fail(ProtocolError("bad magic"))
    assert session.state == "lost" and session.stats.protocol_errors == 1
    assert [type(m) for m in control.sent] == [_wire.Error] and control.closed
    assert ended and ended[0][0] == "lost"


@pytest.mark.timeout(10)
def test_a_failure_after_the_session_ended_is_ignored(caplog):
    ended: list = []
    session, control = _session(ended)
    session.close("no message from actor 7 for 1.5s", lost=True)
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="rlink_ucx.session.learner_session")
    session.fail(ProtocolError("session is closed"))  # the header of a frame already on its way
    assert session.stats.protocol_errors == 0 and control.sent == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(ended) == 1

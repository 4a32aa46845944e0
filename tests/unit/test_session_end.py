"""A session that has ended ignores late data-plane failures (no warning, no error sent)."""

import logging
from types import SimpleNamespace

import pytest

from rlink_ucx.errors import ProtocolError
from rlink_ucx.observe.ratelog import RateLimitedLog
from rlink_ucx.session.learner.session import LearnerSession
from rlink_ucx.transport.session_state import SessionState
from rlink_ucx.wire import messages as _wire


class _Control:
    def __init__(self):
        self.sent, self.closed = [], False

    def send(self, msg):
        self.sent.append(msg)

    def close(self):
        self.closed = True


def _session(ended: list) -> tuple[LearnerSession, _Control]:
    server = SimpleNamespace(session_ended=lambda s, err: ended.append((s.state, err)), token=None,
                             quiet_log=RateLimitedLog(logging.getLogger("test")))
    control = _Control()
    hello = _wire.Hello(7, 0, "test", "tcp", False, "host", 1)
    return LearnerSession(server, 1, control, hello, 7, "tcp", "test", b"t" * 32), control


@pytest.mark.timeout(10)
def test_a_protocol_error_ends_an_open_session_and_is_reported():
    ended: list = []
    session, control = _session(ended)
    session.fail(ProtocolError("bad magic"))
    assert session.state is SessionState.LOST and session.stats.protocol_errors == 1
    assert [type(m) for m in control.sent] == [_wire.Error] and control.closed
    assert ended and ended[0][0] is SessionState.LOST


@pytest.mark.timeout(10)
def test_a_failure_after_the_session_ended_is_ignored(caplog):
    ended: list = []
    session, control = _session(ended)
    session.close("no message from actor 7 for 1.5s", lost=True)
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="rlink_ucx.session.learner.session")
    session.fail(ProtocolError("session is closed"))  # the header of a frame already on its way
    assert session.stats.protocol_errors == 0 and control.sent == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(ended) == 1


@pytest.mark.timeout(10)
def test_a_receiver_stopping_after_the_learner_shut_down_raises_nothing():
    # At exit a receive thread may see its actor's EOF after the learner's loop has closed:
    # there is nobody left to tell, and its thread must not die with a traceback.
    import asyncio

    from rlink_ucx.config import Config
    from rlink_ucx.session.learner.credit import CreditGranter

    loop = asyncio.new_event_loop()
    loop.close()
    session, _ = _session([])
    session.server.loop = loop
    session.fail_threadsafe(EOFError("actor closed the data connection"))
    CreditGranter({}, Config(), loop).request_grant()
    open_loop = asyncio.new_event_loop()  # while the loop runs, the failure is still delivered
    try:
        session.server.loop = open_loop
        session.fail_threadsafe(ProtocolError("bad magic"))
        open_loop.call_soon(open_loop.stop)
        open_loop.run_forever()
    finally:
        open_loop.close()
    assert session.state is SessionState.LOST and session.stats.protocol_errors == 1

"""A flush's Sync goes only on a session that is up: while a reconnect handshakes on a new
control connection, a Sync would reach the learner before the Hello, which ends that
connection ("expected Hello, got Sync") and stalls the reconnect; the flush asks again."""

from __future__ import annotations

import asyncio

from rlink_ucx import Config
from rlink_ucx.session.actor.outbox import Outbox
from rlink_ucx.session.actor.state import LinkState
from rlink_ucx.wire import messages as _wire


class Recording:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)


def test_sync_waits_for_the_session_and_goes_once_it_is_up():
    loop = asyncio.new_event_loop()
    try:
        state = LinkState("127.0.0.1", 9, "tcp", 0, Config(), loop, None)
        outbox = Outbox(state, None, lambda exc: None)  # type: ignore[arg-type]  # no I/O thread needed
        control = Recording()
        state.control = control  # type: ignore[assignment]  # a new connection, still handshaking
        outbox.sync(10)
        assert control.sent == []
        state.connected = True
        outbox.sync(10)
        assert control.sent == [_wire.Sync(10)]
        outbox.acked = 10
        outbox.sync(10)  # already acknowledged: nothing to ask
        assert control.sent == [_wire.Sync(10)]
        assert state.home == ("127.0.0.1", 9) and state.rank == 0
    finally:
        loop.close()

"""A learner that finishes sends Bye on the control connection, then closes the data plane and
weights streams. An actor that notices one of those first must still end with Closed (final)
once the control reader reads the Bye, not take the goodbye for a crash and retry the learner for
``reconnect_timeout`` (seen as a flush timing out after 30 s when a learner closed under load)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlink_ucx import Config
from rlink_ucx.errors import Closed, PeerLost
from rlink_ucx.session.actor import reconnect
from rlink_ucx.session.actor.reconnect import Reconnect


class Link(Reconnect):
    """Reconnect with its own state, connector and outbox: the control reader is a task that
    reports ``reader_says`` after ``reader_after`` seconds; connection attempts are counted."""

    def __init__(self, reader_says: Any, reader_after: float):
        self.config = Config(reconnect_timeout=60)
        self.closing, self.connected, self.error = False, True, None
        self.host, self.port = "127.0.0.1", 9
        self.home, self.rank, self.actor_id = (self.host, self.port), 0, 7
        self.ready: Any = None
        self.proposal: Any = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.attempts = 0
        self.woken = 0
        self.reader_says, self.reader_after = reader_says, reader_after
        self.reader_task: asyncio.Task[Any] | None = None
        super().__init__(self, self, self)  # type: ignore[arg-type]

    async def read_control(self) -> None:
        await asyncio.sleep(self.reader_after)
        self.fail(self.reader_says)

    async def connect(self, timeout: float, answered_timeout: float) -> None:
        self.attempts += 1
        raise PeerLost("nobody there")

    def fail_waiters(self) -> None:
        self.woken += 1

    def _teardown(self) -> None:
        if self.reader_task is not None:
            self.reader_task.cancel()


async def lose_the_data_plane(link: Link, seconds: float) -> None:
    link.loop = asyncio.get_running_loop()
    link.ready = link.loop.create_future()
    link.reader_task = link.loop.create_task(link.read_control())
    link.fail(PeerLost("the data plane broke"), bye_may_follow=True)  # noticed before the control reader ran
    deadline = link.loop.time() + seconds
    while link.error is None and link.loop.time() < deadline:
        await asyncio.sleep(0.01)


@pytest.fixture(autouse=True)
def long_grace(monkeypatch):
    """A grace far longer than the tests' windows: what ends the wait early is then visible."""
    monkeypatch.setattr(reconnect, "GOODBYE_GRACE", 5.0)


@pytest.mark.timeout(30)
def test_a_bye_read_after_the_data_plane_broke_ends_the_actor_with_closed_at_once():
    link = Link(Closed("the learner closed the session (learner closing)"), reader_after=0.05)
    asyncio.run(lose_the_data_plane(link, 5))
    assert isinstance(link.error, Closed) and link.attempts == 0 and link.woken == 1


@pytest.mark.timeout(30)
def test_a_broken_control_connection_is_still_a_crash_and_is_retried():
    link = Link(PeerLost("control connection broke"), reader_after=0.05)
    asyncio.run(lose_the_data_plane(link, 1.0))
    # reconnecting, not ended; and attempts began before the grace ran out (the reader had ended)
    assert link.error is None and link.attempts >= 1
    # The old connection's end, read during the grace, is not reported to the attempt's waiters
    # (a schema proposal in flight is asked again on the new connection, not failed).
    assert not link.ready.done()


@pytest.mark.timeout(30)
def test_a_silent_learner_is_retried_at_once_without_waiting_for_a_goodbye():
    # A heartbeat timeout: the control connection itself is silent, no Bye can be on its way.
    link = Link(Closed("never read"), reader_after=100)

    async def go_silent() -> None:
        link.loop = asyncio.get_running_loop()
        link.ready = link.loop.create_future()
        link.reader_task = link.loop.create_task(link.read_control())
        link.fail(PeerLost("no message from the learner for 1.5s"))
        await asyncio.sleep(1.0)

    asyncio.run(go_silent())
    assert link.error is None and link.attempts >= 1

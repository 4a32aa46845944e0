"""The first connection's retry schedule: an actor started before its learner tries again at
least every 0.75 s while nothing listens (connection refused), so it meets a learner soon after
it comes up; a learner that is there but does not answer gets the longer backoff (up to 3 s)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlink_ucx import Config
from rlink_ucx.errors import AuthError, ConnectError, PeerLost
from rlink_ucx.session.actor.reconnect import REFUSED_BACKOFF, Reconnect


class Attempts(Reconnect):
    """Just the retry loop: every attempt fails with ``error()``; the sleeps are recorded."""

    def __init__(self, error: Any, attempts: int):
        self.config = Config(connect_timeout=3600)
        self.closing = False
        self.host, self.port = "127.0.0.1", 9
        self.home, self.rank, self.actor_id = (self.host, self.port), 0, 7
        self.error, self.left = error, attempts
        self.targets: list[tuple[str, int]] = []
        self.slept: list[float] = []
        super().__init__(self, self, self)  # type: ignore[arg-type]  # its own state, connector and outbox

    def go_home(self) -> None:
        self.host, self.port = self.home
        self.rank = 0

    async def connect(self, timeout: float, answered_timeout: float) -> None:
        self.targets.append((self.host, self.port))
        self.left -= 1
        if self.left == 0:
            self.closing = True  # stop the loop after this attempt
        raise self.error()

    def _teardown(self) -> None:
        pass


def refused() -> ConnectError:
    try:
        raise ConnectionRefusedError(111, "Connect call failed")
    except ConnectionRefusedError as exc:
        try:
            raise ConnectError("cannot reach learner at 127.0.0.1:9") from exc
        except ConnectError as err:
            return err


def timed_out() -> ConnectError:
    try:
        raise TimeoutError()
    except TimeoutError as exc:
        try:
            raise ConnectError("cannot reach learner at 127.0.0.1:9: timed out") from exc
        except ConnectError as err:
            return err


def run(attempts: Attempts, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], Any]:
    """The sleeps between the attempts, and the last error."""

    async def sleep(seconds: float) -> None:
        attempts.slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    last = asyncio.run(attempts._retry_connect(float("inf"), None))
    return attempts.slept, last


@pytest.mark.parametrize("raw", [False, True], ids=["ConnectError", "bare OSError"])
def test_refused_connections_are_retried_at_least_every_three_quarters_of_a_second(monkeypatch, raw):
    # raw: an OSError that is not wrapped, kept as the cause of the PeerLost it becomes
    slept, last = run(Attempts((lambda: ConnectionRefusedError(111, "refused")) if raw else refused, 30), monkeypatch)
    assert isinstance(last, PeerLost if raw else ConnectError)
    assert len(slept) == 29
    assert max(slept) <= 1.5 * REFUSED_BACKOFF and max(slept[10:]) >= 0.5 * REFUSED_BACKOFF, slept


def test_a_learner_that_does_not_answer_gets_the_longer_backoff(monkeypatch):
    slept, last = run(Attempts(timed_out, 30), monkeypatch)
    assert isinstance(last, ConnectError)
    assert max(slept) > 1.5 * REFUSED_BACKOFF and max(slept) <= 3.0, slept


def test_an_actor_whose_rank_does_not_answer_asks_rank_0_at_once(monkeypatch):
    # Rank 0 of a job of many learners sent the actor to rank 2 at port 7002; rank 2 is gone.
    attempts = Attempts(refused, 3)
    attempts.host, attempts.port, attempts.rank = "127.0.0.1", 7002, 2
    slept, last = run(attempts, monkeypatch)
    assert attempts.targets == [("127.0.0.1", 7002), ("127.0.0.1", 9), ("127.0.0.1", 9)]
    assert len(slept) == 1 and attempts.rank == 0  # no wait before asking rank 0; rank 0's refusal backs off
    assert isinstance(last, ConnectError)


def squatter() -> AuthError:
    return AuthError("learner: token proof did not match (wrong token?)")


def test_an_auth_error_at_a_rank_s_address_sends_the_actor_back_to_rank_0(monkeypatch):
    # The rank at port 7002 died and another process answers there with an auth error: the
    # actor asks rank 0 (whose own refusal is the only final one) instead of failing.
    attempts = Attempts(squatter, 3)
    attempts.host, attempts.port, attempts.rank = "127.0.0.1", 7002, 2
    slept, last = run(attempts, monkeypatch)
    assert attempts.targets == [("127.0.0.1", 7002), ("127.0.0.1", 9)] and attempts.rank == 0
    assert len(slept) == 1  # a refusing rank backs off before rank 0 is asked (it may place it there again)
    assert isinstance(last, AuthError)  # rank 0's own auth failure ended it


def test_rank_0_s_own_auth_failure_is_final(monkeypatch):
    slept, last = run(Attempts(squatter, 5), monkeypatch)
    assert slept == [] and isinstance(last, AuthError)

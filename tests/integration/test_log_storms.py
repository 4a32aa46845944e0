"""A reconnect storm or a flood of wrong tokens writes a few log lines, not one per connection."""

from __future__ import annotations

import logging
import os
import time

import pytest

from rlink_ucx import Learner
from tests.integration.hostile import RawActor

TOKEN = b"storm-token-" + b"x" * 20


def _storm(address: str, n: int, token: bytes) -> int:
    """``n`` sessions that say Hello and drop the connection without a goodbye (each ends as
    lost); returns how many got a Welcome."""
    welcomed = 0
    for _ in range(n):
        raw = RawActor(address, token)
        try:
            raw.hello(pid=os.getpid(), transport="tcp")
            welcomed += 1
        except (ConnectionError, AssertionError, OSError):
            pass
        finally:
            raw.close()
    return welcomed


@pytest.mark.timeout(180)
def test_a_reconnect_storm_and_a_wrong_token_flood_are_a_few_lines_each(caplog):
    caplog.set_level(logging.INFO, logger="rlink_ucx")
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        started = time.monotonic()
        assert _storm(learner.address, 300, TOKEN) == 300
        _storm(learner.address, 100, b"wrong-token-" + b"y" * 20)
        deadline = time.monotonic() + 30
        while learner.stats()["connected_actors"] and time.monotonic() < deadline:
            time.sleep(0.05)
        seconds = time.monotonic() - started
        assert learner.stats()["connected_actors"] == 0
    ended = [r for r in caplog.records if "session" in r.getMessage() and "ended" in r.getMessage()]
    refused = [r for r in caplog.records if r.getMessage().startswith("refused")]
    periods = 1 + int(seconds // 10)  # five lines per kind per 10 s
    assert 1 <= len(ended) <= 5 * periods, (len(ended), seconds)
    assert 1 <= len(refused) <= 5 * periods, (len(refused), seconds)
    assert len(caplog.records) < 60, [r.getMessage()[:80] for r in caplog.records[:80]]

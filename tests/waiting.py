"""Waiting on a condition, not for a fixed time: the one helper the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` every ``interval`` seconds until it is true or ``timeout`` seconds
    passed; returns its last answer (``assert wait_until(...)`` fails on a timeout)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)
    return True


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """:func:`wait_until`, failing the test with ``what`` on a timeout."""
    assert wait_until(predicate, timeout), what

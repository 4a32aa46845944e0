"""Actor processes for the credit-fairness tests (spawned: importable, top level)."""

from __future__ import annotations

import time

import numpy as np


def busy_actors(address: str, ids: list[int], seconds: float, results) -> None:
    """Actors that put a step every 0.4 s for ``seconds``: never idle (an actor silent for a
    second gives its credit back anyway), but far from spending the credit they hold."""
    from rlink_ucx import Actor

    actors = [Actor(address, transport="tcp", actor_id=i) for i in ids]
    sent = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        for a in actors:
            a.put({"x": np.int64(-1)})
            sent += 1
        time.sleep(0.4)
    for a in actors:
        a.flush(30)
        a.close()
    results.put({"busy_steps": sent})


def late_actors(address: str, ids: list[int], delay: float, results) -> None:
    """Actors that connect while others are busy, put one step each and time their flush."""
    from rlink_ucx import Actor

    time.sleep(delay)
    actors = [Actor(address, transport="tcp", actor_id=i) for i in ids]
    for a in actors:
        a.put({"x": np.int64(a.actor_id)})
    waits = []
    for a in actors:
        start = time.monotonic()
        a.flush(15)  # raises Backpressure/TimeoutError if its step never got credit
        waits.append(time.monotonic() - start)
    results.put({"late_flush_s": waits})
    time.sleep(1.0)  # stay connected while the test reads the learner's credit books
    for a in actors:
        a.close()

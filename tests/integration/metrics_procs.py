"""Code that runs in the spawned actor processes of test_metrics.py: numpy and rlink_ucx only, so
a child does not import torch, pytest and prometheus_client, as one unpickling a function of the
test module did."""

from __future__ import annotations

import numpy as np

from rlink_ucx import Actor

TOKEN = "x" * 32


def counting_actor(address: str, actor: int, n: int, results, leave) -> None:
    """Put ``n`` steps in chunks of 100, flush, report, and stay connected until ``leave``."""
    with Actor(address, token=TOKEN, transport="tcp", actor_id=actor) as a:
        for start in range(0, n, 100):
            k = min(100, n - start)
            a.put_many({"x": np.arange(start, start + k, dtype=np.int64), "obs": np.ones((k, 4), np.float32)})
        a.flush(60)
        results.put(("flushed", actor))
        leave.wait(60)


def wrong_token_actor(address: str, results) -> None:
    from rlink_ucx import RLinkError

    try:
        with Actor(address, token="y" * 32, transport="tcp"):
            results.put(("connected", None))
    except RLinkError as exc:
        results.put((type(exc).__name__, str(exc)))

"""Actor processes for the replay integration tests (importable by spawned children)."""

from __future__ import annotations

import time

import numpy as np

from tests.integration.procs import encoded_steps


def priority_of(actor: int, seq: np.ndarray) -> np.ndarray:
    return (actor + (np.asarray(seq) % 13) / 4).astype(np.float32)


def replay_actor(address: str, transport: str, actor: int, n: int, results=None, pace: float = 0.0,
                 put_timeout: float = 30.0, frame_bytes: int | None = None) -> None:  # fmt: skip
    """Put ``n`` encoded steps with priorities, alternating single puts and chunks of 37;
    report how long the puts took and the actor's counters."""
    from rlink_ucx import Actor, Config

    steps = encoded_steps(actor, n)
    started = time.monotonic()
    config = Config(put_timeout=put_timeout, **({"frame_bytes": frame_bytes} if frame_bytes else {}))
    with Actor(address, transport=transport, actor_id=actor, config=config) as a:
        seq = 0
        while seq < n:
            if (seq // 300) % 2 == 0:
                a.put({k: v[seq] for k, v in steps.items()}, priority=float(priority_of(actor, seq)))
                seq += 1
            else:
                k = min(37, n - seq)
                a.put_many({f: v[seq : seq + k] for f, v in steps.items()},
                           priority=priority_of(actor, np.arange(seq, seq + k)))  # fmt: skip
                seq += k
                if pace:
                    time.sleep(pace)
        a.flush(120)
        stats = a.stats()
    if results is not None:
        results.put({"actor": actor, "seconds": time.monotonic() - started, "lost": stats["steps_lost"],
                     "credit_waits": stats["credit_waits"], "acked": stats["steps_acked"]})  # fmt: skip

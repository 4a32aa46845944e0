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


def frame_of(actor: int, seq) -> np.ndarray:
    """An 84x84x4 uint8 observation whose every byte depends on (actor, seq)."""
    seq = np.asarray(seq, dtype=np.int64).reshape(-1, 1)
    return ((seq * 7 + actor * 3 + np.arange(84 * 84 * 4)) % 251).astype(np.uint8).reshape(-1, 84, 84, 4)


def frames_actor(address: str, actor: int, n: int) -> None:
    """Put ``n`` Atari-sized steps with priorities: put_many of 32, a single put now and then."""
    from rlink_ucx import Actor

    with Actor(address, transport="shm", actor_id=actor) as a:
        seq = 0
        while seq < n:
            k = 1 if seq % 500 == 0 else min(32, n - seq)
            s = np.arange(seq, seq + k)
            a.put_many({"obs": frame_of(actor, s), "action": actor * 1_000_000 + s}, priority=priority_of(actor, s))
            seq += k
        a.flush(120)

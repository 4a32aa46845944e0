"""Code that runs in spawned actor processes (importable by the children)."""

from __future__ import annotations

import numpy as np


def encoded_steps(actor: int, n: int) -> dict[str, np.ndarray]:
    """Steps whose values encode (actor, seq), so the learner can check every byte."""
    seq = np.arange(n, dtype=np.int64)
    return {
        "obs": np.stack([np.full(n, actor, np.float32), seq.astype(np.float32), (seq * 0.5).astype(np.float32)], 1),
        "action": actor * 1_000_000 + seq,
        "reward": (seq % 7).astype(np.float16),
        "done": seq % 11 == 0,
    }


def version_of(seq: int) -> int:
    return seq // 1000


def stream_actor(address: str, transport: str, actor: int, n: int, mode: str = "mixed") -> None:
    """Put ``n`` encoded steps: single puts and put_many chunks, with changing versions."""
    from rlink_ucx import Actor

    steps = encoded_steps(actor, n)
    with Actor(address, transport=transport, actor_id=actor) as a:
        seq = 0
        while seq < n:
            if mode == "mixed" and (seq // 500) % 2 == 0:  # single steps
                a.put({k: v[seq] for k, v in steps.items()}, version=version_of(seq))
                seq += 1
            else:  # chunks that never straddle a version change
                k = min(37, n - seq, 1000 - seq % 1000)
                a.put_many({f: v[seq : seq + k] for f, v in steps.items()}, version=version_of(seq))
                seq += k
        a.flush(60)


def int_actor(address: str, actor: int, n: int) -> None:
    """Put int64 steps 0..n-1 in chunks of 100 over tcp."""
    from rlink_ucx import Actor

    with Actor(address, transport="tcp", actor_id=actor) as a:
        for start in range(0, n, 100):
            a.put_many({"x": np.arange(start, start + 100, dtype=np.int64)})
        a.flush(30)


def lingering_actor(address: str, transport: str, n: int) -> None:
    """Tiny frames and a 1 ms linger: full-frame hand-offs race the linger tick constantly."""
    from rlink_ucx import Actor, Config

    config = Config(frame_bytes=2048, frame_linger=0.001)
    with Actor(address, transport=transport, actor_id=9, config=config) as a:
        for start in range(0, n, 50):
            a.put_many({"x": np.arange(start, start + 50, dtype=np.int64)})
            if start % 1000 == 0:
                a.put({"x": np.int64(-1)})  # a lone step leaves a partial frame for the tick
        a.flush(60)

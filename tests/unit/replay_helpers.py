"""Helpers for the replay unit tests: a real StepRing fed by hand, as the I/O threads would."""

from __future__ import annotations

import threading
import time

import numpy as np

from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import Schema

SCHEMA = Schema.from_spec({"obs": ("float32", (3,)), "action": ("int64", ()), "done": ("bool", ())})
PRIO_SCHEMA = Schema.from_spec({"obs": ("float32", (3,)), "action": ("int64", ()), "done": ("bool", ()),
                                "_priority": ("float32", ())})  # fmt: skip


def new_ring(schema: Schema = SCHEMA, steps: int = 4096, frame: int = 64) -> StepRing:
    return StepRing(schema, steps * schema.step_bytes, frame)


def steps(actor: int, seq: int, n: int, priority: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Steps whose values encode (actor, seq): obs = [actor, seq, seq / 2], action = actor * 1e6 + seq."""
    s = np.arange(seq, seq + n)
    out = {
        "obs": np.stack([np.full(n, actor), s, s / 2], 1).astype(np.float32),
        "action": (actor * 1_000_000 + s).astype(np.int64),
        "done": s % 5 == 4,
    }
    if priority is not None:
        out["_priority"] = np.asarray(priority, dtype=np.float32)
    return out


def feed(ring: StepRing, actor: int, seq: int, values: dict[str, np.ndarray], version: int = 0) -> None:
    """Write one frame into the ring as a receiving plane does (reserve, fill the views, commit)."""
    n = len(next(iter(values.values())))
    ring.grant(n)
    seg = ring.reserve(n, actor, seq, version)
    for spec, views in zip(ring.schema.fields, ring.field_views(seg)):
        raw = np.ascontiguousarray(values[spec.name]).view(np.uint8).reshape(-1)
        at = 0
        for v in views:
            v[:] = raw[at : at + len(v)]
            at += len(v)
    ring.commit(seg)


def put(ring: StepRing, actor: int, seq: int, n: int, frame: int = 64, version: int = 0, priority=None) -> None:
    for lo in range(0, n, frame):
        k = min(frame, n - lo)
        p = None if priority is None else np.asarray(priority)[lo : lo + k]
        feed(ring, actor, seq + lo, steps(actor, seq + lo, k, p), version)


def stream(ring: StepRing, actor: int, seq: int, n: int, frame: int = 64, timeout: float = 20.0) -> None:
    """``put``, but each frame waits for room in the ring first, as an actor waits for credit:
    a ring smaller than the steps streamed through it is emptied by its reader meanwhile."""
    deadline = time.monotonic() + timeout
    for lo in range(0, n, frame):
        k = min(frame, n - lo)
        while ring.grantable() < k:
            assert time.monotonic() < deadline, "the reader did not free the ring"
            time.sleep(0.0005)
        feed(ring, actor, seq + lo, steps(actor, seq + lo, k))


class FakeLearner:
    """What ReplayDataset uses of a Learner: its version, rank, config, closed flag and feed (this
    object itself: a ring that is there at once, or once ``ready`` is set)."""

    def __init__(self, ring: StepRing | None):
        from rlink_ucx import Config

        self.ring = ring
        self.version = 0
        self.rank, self.world_size = 0, 1  # a lone learner
        self.closed = False
        self.config = Config()
        self.ready = threading.Event()
        if ring is not None:
            self.ready.set()

    def feed(self, *, exclusive: bool = False) -> FakeLearner:
        return self

    def release(self) -> None:
        self.released = True

    def wait_ring(self, timeout: float):
        return self.ring if self.ready.wait(timeout) else None

    def on_close(self, close) -> None:
        pass  # nothing to close: the tests close their replays

    def hint_batch_size(self, batch_size: int) -> None:
        self.hinted = batch_size  # the ring here is made by the test, with its own chunk size


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()

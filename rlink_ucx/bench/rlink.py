"""The rlink rows: ``Actor.put`` (``put_many`` when a chunk holds more than one step) ->
``RLinkDataset.fetch`` in batches of about 4 MiB, on one data plane, with 1 or more actor processes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import TimeoutError as FetchTimeout
from .common import BATCH_BYTES
from .harness import Receiver, Sender, run_session
from .measure import Recorder, Timing
from .workloads import Workload

MiB = 1 << 20
MAX_BATCH_STEPS = 16384  # batches of about 4 MiB, at most this many steps (CartPole: 16384 steps, 0.6 MiB)


def rlink_config(workload: Workload, actors: int = 1) -> tuple[dict[str, int], int]:
    """Learner/actor config overrides and the batch size for ``workload`` sent by ``actors``.

    The ring holds 16 batches, and at least ``2 * actors * Config.actor_window_bytes``: the
    learner lends the actors half the ring, split evenly, so a ring sized for one actor leaves
    each of 4 an eighth of it (8 MiB of 64), and they keep running out of credit, where a raw
    socket's senders have the kernel's buffers of each connection to themselves. See
    docs/benchmarks.md, "4 actors against 1".
    """
    from ..config import Config

    step = workload.wire_step_bytes
    batch = max(1, min(BATCH_BYTES // step, MAX_BATCH_STEPS))
    ring = max(64 * MiB, 16 * batch * step, 2 * actors * Config.from_env().actor_window_bytes)
    return {"buffer_bytes": ring, "max_frame_bytes": max(64 * MiB, 2 * step)}, batch


class RlinkSender(Sender):
    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        from .. import Actor, Config

        super().__init__(info, workload, index, timeout)
        address, transport, overrides, self.batch, api = info
        self.api = api if api != "auto" else ("put" if workload.chunk == 1 else "put_many")
        self.key: Any = None
        self.step: dict[str, np.ndarray] = {}
        self.actor = Actor(address, transport=transport, config=Config.from_env(**overrides))

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        if self.api == "put_many":
            self.actor.put_many({"t_ns": t_ns, **arrays})
            return
        if self.key is not t_ns:  # one step's views (0-d for scalars), made once: t_ns is filled in place
            self.key = t_ns
            self.step = {name: a[0:1].reshape(a.shape[1:]) for name, a in {"t_ns": t_ns, **arrays}.items()}
        self.actor.put(self.step)

    def finish(self, marker: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        # A whole batch of markers, so the learner's last fetch completes; sent with the same calls
        # as the data (one put_many of the whole batch could exceed the learner's per-frame limit
        # when resending is off: see docs/bench-suite.md).
        for _ in range(-(-self.batch // self.workload.chunk)):
            self.send(marker, arrays)
        self.actor.flush(self.timeout)

    def close(self) -> None:
        self.actor.close()


class RlinkReceiver(Receiver):
    def __init__(self, workload: Workload, transport: str, timeout: float, api: str = "auto", actors: int = 1,
                 format: str = "torch"):  # fmt: skip
        from .. import Config, Learner, RLinkDataset

        self.api = api
        self.overrides, self.batch = rlink_config(workload, actors)
        self.transport = transport
        self.timeout = timeout
        self.learner = Learner("127.0.0.1:0", transport=transport, config=Config.from_env(None, **self.overrides))
        self.dataset = RLinkDataset(self.learner, batch_size=self.batch, format=format)
        self.seen: set[int] = set()
        # One latency per sender call's worth of steps, as the other rows record one per message
        # (a call's steps share its stamp): one per step cost this thread, the one that fetches,
        # 0.3 GB/s of arrays kept at 40 M CartPole steps/s.
        self.every = workload.chunk

    def info(self) -> Any:
        return (self.learner.address, self.transport, self.overrides, self.batch, self.api)

    def recv(self, rec: Recorder) -> int:
        deadline = time.monotonic() + self.timeout
        while True:  # in slices, so a failed sender is noticed
            try:
                batch = self.dataset.fetch(timeout=min(2.0, max(0.01, deadline - time.monotonic())))
                break
            except FetchTimeout:
                self.check()
                if time.monotonic() > deadline:
                    raise
        now = time.monotonic_ns()
        t = np.asarray(batch["t_ns"])  # torch, numpy, JAX or TensorFlow (bench/formats.py)
        if not (t < 0).any():
            rec.add(now, len(t), now - t[:: self.every])
            return 0
        data = t >= 0
        new = set(np.asarray(batch.actor_id)[~data].tolist()) - self.seen
        self.seen |= new
        if data.any():
            rec.add(now, int(data.sum()), now - t[data][:: self.every])
        return len(new)

    def close(self) -> None:
        self.learner.close()


def run_rlink(workload: Workload, timing: Timing, transport: str, actors: int, api: str = "auto",
              format: str = "torch") -> dict[str, Any]:  # fmt: skip
    """``api``: the actor's call, "put", "put_many", or "auto" (put for one step per chunk).
    ``format``: the batches' framework (``RLinkDataset(format=...)``)."""
    receiver = RlinkReceiver(workload, transport, timing.timeout, api, actors, format)
    return run_session(receiver, f"{__name__}:RlinkSender", workload, timing, actors)

"""Replay sampling and insert benchmarks (``rlink bench --suite replay``; see replay.py there).

Tables are filled without actors through a real ``StepRing`` fed as a receiving plane does;
``ReplayDataset._core`` is read for the sum tree's own timing.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from ..learner import Learner

Spec = dict[str, tuple[str, tuple[int, ...]]]  # field -> (dtype, shape), as Schema.from_spec takes
ATARI: Spec = {"obs": ("uint8", (84, 84, 4)), "action": ("int64", ()), "reward": ("float32", ()), "done": ("bool", ())}
SMALL: Spec = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ()), "done": ("bool", ())}
B = 256


class Source:
    """What ReplayDataset uses of a Learner, around a StepRing fed by this process."""

    def __init__(self, ring: Any):
        from ..config import Config

        self.ring, self.version, self.closed, self.config = ring, 0, False, Config()
        self.rank, self.world_size = 0, 1  # a lone learner (its checkpoints are not per rank)

    def feed(self, *, exclusive: bool = False) -> Source:
        return self  # ReplayDataset reads its learner through feed(): this object plays both

    def release(self) -> None:
        pass  # the only reader of its ring

    def wait_ring(self, timeout: float) -> Any:
        return self.ring

    def on_close(self, close: Any) -> None:
        pass  # the runs close their replays themselves

    def hint_batch_size(self, batch_size: int) -> None:
        pass  # the ring is made before the replay here, with chunks of a batch (as a learner's)


def source(ring: Any) -> Learner:
    """A :class:`Source` where ReplayDataset takes a Learner (it reads only what Source has)."""
    return cast("Learner", Source(ring))


def fill(spec: Spec, capacity: int, **kw: Any) -> Any:
    """A ReplayDataset holding ``capacity`` steps of ``spec``, fed through a real StepRing."""
    from ..replay import ReplayDataset
    from ..store.ring import StepRing
    from ..wire.codec import Schema

    schema = Schema.from_spec(spec)
    frame = max(1, (1 << 20) // schema.step_bytes)
    ring = StepRing(schema, 64 << 20, frame, chunk_steps=B)  # as the learner makes it for a replay
    replay = ReplayDataset(source(ring), capacity=capacity, batch_size=B, **kw)
    payload = [np.random.default_rng(0).integers(0, 255, frame * f.step_bytes, dtype=np.uint8) for f in schema.fields]
    seq = 0
    while seq < capacity:
        n = min(frame, capacity - seq)
        while ring.grantable() < n:
            time.sleep(0.0005)
        ring.grant(n)
        seg = ring.reserve(n, 1, seq, 0)
        for data, views in zip(payload, ring.field_views(seg)):
            at = 0
            for v in views:
                v[:] = data[at : at + len(v)].data
                at += len(v)
        ring.commit(seg)
        seq += n
    deadline = time.monotonic() + 600
    while replay.inserted < capacity:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the table was not filled: {replay.inserted} of {capacity} steps")
        time.sleep(0.001)
    return replay


def bench_uniform(capacity: int, seconds: float, device: str = "cpu", storage: str = "host",
                  prefetch: int | None = None) -> dict[str, Any]:  # fmt: skip
    """``sample()`` of B Atari steps in a loop: batches/s, items/s, GB/s gathered."""
    import torch

    replay = fill(ATARI, capacity, sampler="uniform", device=device, storage=storage, prefetch=prefetch)
    cuda = replay.device.type == "cuda"
    for _ in range(5):
        replay.sample(10)
    if cuda:
        torch.cuda.synchronize(replay.device)
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        replay.sample(10)
        n += 1
    if cuda:  # the batches are on the device once their copies (or gathers) are done
        torch.cuda.synchronize(replay.device)
    per_s = n / (time.perf_counter() - started)
    step_bytes = 84 * 84 * 4 + 8 + 4 + 1
    replay.close()
    from ..store.replay import split_gather

    return {"capacity": capacity, "batch": B, "device": str(replay.device), "storage": storage, "prefetch": replay.prefetch,
            "split_gather": split_gather.enabled and storage == "host", "batches_per_s": round(per_s, 1), "items_per_s": round(per_s * B),
            "gb_per_s": round(per_s * B * step_bytes / 1e9, 2)}  # fmt: skip


def bench_prioritized(capacity: int, reps: int) -> dict[str, Any]:
    """ms per ``sample()`` + ``update_priorities()`` of B at ``capacity``, and the sum tree's share."""
    replay = fill(SMALL, capacity, sampler="prioritized", seed=0)
    rng = np.random.default_rng(1)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        b = replay.sample(10)
        replay.update_priorities(b.index, rng.random(B) + 0.01)
        times.append(time.perf_counter() - t)
    tree = replay._core.sampler.tree
    tree_times = []
    for _ in range(reps):
        t = time.perf_counter()
        slots = tree.sample(rng, B)
        tree.set(slots, rng.random(B))
        tree_times.append(time.perf_counter() - t)
    replay.close()
    return {"capacity": capacity, "batch": B, "ms_per_sample_update": round(statistics.median(times) * 1e3, 3),
            "p90_ms": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3),
            "sum_tree_ms": round(statistics.median(tree_times) * 1e3, 3)}  # fmt: skip


# --- insert rate: replay vs RLinkDataset on the same actor stream ------------------------------------
def _streamer(address: str, spec: Spec, chunk: int, stop: Any) -> None:
    from ..actor import Actor
    from ..errors import Closed

    rng = np.random.default_rng(0)
    steps = {k: rng.integers(0, 100, (chunk, *shape)).astype(dt) for k, (dt, shape) in spec.items()}
    try:
        with Actor(address) as actor:
            while not stop.is_set():
                actor.put_many(steps)
    except Closed:
        pass


def _insert_run(kind: str, spec: Spec, chunk: int, seconds: float) -> float:
    from ..dataset import RLinkDataset
    from ..errors import RLinkError
    from ..learner import Learner
    from ..replay import ReplayDataset

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    with Learner("127.0.0.1:0") as learner:
        if kind == "replay":
            replay = ReplayDataset(learner, capacity=200_000 if spec is SMALL else 20_000, batch_size=B)

            def count() -> int:
                return replay.inserted
        else:
            dataset = RLinkDataset(learner, batch_size=B)
            got = [0]

            def consume() -> None:
                try:
                    while True:
                        dataset.fetch(timeout=30)
                        got[0] += B
                except RLinkError:  # the learner closed: the run is over
                    return

            threading.Thread(target=consume, daemon=True).start()

            def count() -> int:
                return got[0]

        proc = ctx.Process(target=_streamer, args=(learner.address, spec, chunk, stop))
        proc.start()
        deadline = time.monotonic() + 60
        while count() < 4 * B and time.monotonic() < deadline:  # warm up: connected and streaming
            time.sleep(0.01)
        time.sleep(0.3)
        n0, t0 = count(), time.perf_counter()
        time.sleep(seconds)
        rate = (count() - n0) / (time.perf_counter() - t0)
        stop.set()
        if kind == "replay":
            replay.close()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    return rate


def bench_insert(seconds: float, reps: int) -> list[dict[str, Any]]:
    """Steps/s into the replay vs into ``RLinkDataset`` from one actor process, alternating runs."""
    rows = []
    for name, spec, chunk in (("small", SMALL, 256), ("atari", ATARI, 32)):
        runs: dict[str, list[float]] = {"rlinkdataset": [], "replay": []}
        for _ in range(reps):  # alternate, so drift of a shared machine hits both
            runs["rlinkdataset"].append(_insert_run("dataset", spec, chunk, seconds))
            runs["replay"].append(_insert_run("replay", spec, chunk, seconds))
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows.append({"workload": name, "rlinkdataset_steps_per_s": round(med["rlinkdataset"]),
                     "replay_steps_per_s": round(med["replay"]), "ratio": round(med["replay"] / med["rlinkdataset"], 3),
                     "runs": {k: [round(x) for x in v] for k, v in runs.items()}})  # fmt: skip
    return rows

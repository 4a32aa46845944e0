"""Parameter fan-out: ``learner.publish`` of a state dict vs one plain broadcast, in one run.

- ``plain-broadcast``: a gloo process group of the root and N receiver processes; the root
  broadcasts one flat tensor of the same total size. Time: from the root's call until the last
  receiver's broadcast returned (CLOCK_MONOTONIC is shared by every process on a host).
- ``rlink-publish``: a Learner and N subscribed actor processes; ``publish(state, wait=True)``
  returns once every actor has the version, verified. Time: that call, snapshot included. The
  actors share the learner's host, so they read each version from its shared memory; with
  ``--no-shared-memory`` they take each version on a weights stream of their own instead, as
  actors on other hosts do.

With ``--device cuda:0`` the state dict lives on the GPU. The plain root then copies its flat
tensor to the host and broadcasts that (what gloo needs; NCCL refuses two ranks on one GPU), and
the copy is inside its time; the actors stay on the host in both systems.

The state dict is ``tensors`` float32 tensors adding up to ``size_mb`` MiB. Repetitions alternate
between the two systems, so drift on a noisy machine hits both alike; medians are reported.

The ``fanout`` rows of ``rlink bench`` call :func:`run`; ``python bench/fanout.py`` is its
command line (device, tensor count, shared memory or not, JSON).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import statistics
import time
from typing import Any


def _state(size_mb: int, tensors: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    per = size_mb * (1 << 20) // 4 // tensors
    return {f"layer{i}.weight": torch.full((per,), float(i), device=device) for i in range(tensors)}


# --- plain broadcast --------------------------------------------------------------------------
def _plain_receiver(port: int, rank: int, world: int, numel: int, reps: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from ..weights.groups import connect_store, new_group

    group = new_group(connect_store("127.0.0.1", port, 60), "plain/", rank, world, backend="gloo",
                      hostname="127.0.0.1", timeout=60)  # fmt: skip
    flat = torch.empty(numel)
    for _ in range(reps + 2):
        group.broadcast(torch.zeros(1), 0).wait()  # start together
        group.broadcast(flat, 0).wait()
        results.put((rank, time.monotonic()))
    del dist


class PlainBroadcast:
    def __init__(self, numel: int, subscribers: int, reps: int, device: str = "cpu"):
        import torch

        from ..weights.groups import new_group, serve_store

        store, port = serve_store("127.0.0.1", 60)
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        world = subscribers + 1
        self.procs = [ctx.Process(target=_plain_receiver, args=(port, r, world, numel, reps, self.results))
                      for r in range(1, world)]  # fmt: skip
        for p in self.procs:
            p.start()
        self.group = new_group(store, "plain/", 0, world, backend="gloo", hostname="127.0.0.1", timeout=60)
        self.flat = torch.ones(numel, device=device)
        self.subscribers = subscribers
        self.store = store

    def once(self) -> float:
        import torch

        self.group.broadcast(torch.zeros(1), 0).wait()
        started = time.monotonic()
        self.group.broadcast(self.flat.cpu(), 0).wait()  # .cpu() is free for a host tensor
        ends = [self.results.get(timeout=60)[1] for _ in range(self.subscribers)]
        return float(max(ends) - started)

    def close(self) -> None:
        for p in self.procs:
            p.join(30)


# --- rlink publish ------------------------------------------------------------------------------
def _subscriber(address: str, until: int, results: Any) -> None:
    # A torch actor has torch loaded before its first version. Imported by the first
    # ``get_remote_model`` instead, it would take 2-3 s of CPU per actor during the measured
    # repetitions (the warm-up publishes do not wait for it), slowing both systems.
    import torch  # noqa: F401

    from .. import Actor

    with Actor(address, transport="tcp", subscribe=True) as actor:
        while actor.get_remote_model(timeout=120, latest=False)[1] < until:
            time.sleep(0.01)
        results.put(actor.stats()["weights"])


class RlinkPublish:
    def __init__(self, subscribers: int, reps: int, shared_memory: bool = True):
        from .. import Config, Learner

        self.learner = Learner("127.0.0.1:0", transport="tcp", config=Config.from_env(weights_shared_memory=shared_memory))
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_subscriber, args=(self.learner.address, reps + 2, self.results))
                      for _ in range(subscribers)]  # fmt: skip
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + 120
        while sum(a["subscribed"] for a in self.learner.stats()["actors"]) < subscribers:
            if time.monotonic() > deadline:
                raise RuntimeError("subscribers did not connect")
            time.sleep(0.05)

    def once(self, state: dict[str, Any]) -> float:
        started = time.monotonic()
        version = self.learner.publish(state, wait=True, timeout=120)
        elapsed = time.monotonic() - started
        if not self.learner.wait_published(version, 0):
            raise RuntimeError(f"version {version} did not reach every subscriber")
        return elapsed

    def close(self) -> dict[str, Any]:
        reports = [self.results.get(timeout=60) for _ in self.procs]
        for p in self.procs:
            p.join(30)
        stats = self.learner.stats()["weights"]
        self.learner.close()
        return {"learner": stats, "actors": reports}


def run(size_mb: int = 100, subscribers: int = 3, reps: int = 5, tensors: int = 25,
        device: str = "cpu", shared_memory: bool = True) -> dict[str, Any]:  # fmt: skip
    state = _state(size_mb, tensors, device)
    numel = sum(t.numel() for t in state.values())
    plain = PlainBroadcast(numel, subscribers, reps, device)
    rlink = RlinkPublish(subscribers, reps, shared_memory)
    times: dict[str, list[float]] = {"plain-broadcast": [], "rlink-publish": []}
    try:
        for _ in range(2):  # warm-up: connections, groups, first-touch page faults of the double buffers
            plain.once()
            rlink.once(state)
        for _ in range(reps):
            times["plain-broadcast"].append(plain.once())
            times["rlink-publish"].append(rlink.once(state))
    finally:
        plain.close()
        detail = rlink.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "size_mb": size_mb,
        "subscribers": subscribers,
        "tensors": tensors,
        "device": device,
        "shared_memory": shared_memory,
        "reps": reps,
        "seconds": times,
        "median_seconds": med,
        "ratio": med["rlink-publish"] / med["plain-broadcast"],
        # Each rlink rep runs right after a plain one: the median of those pairs' ratios is less
        # exposed to the machine's drift than the ratio of the medians.
        "paired_ratio": statistics.median(r / p for r, p in zip(times["rlink-publish"], times["plain-broadcast"])),
        "detail": detail,
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }

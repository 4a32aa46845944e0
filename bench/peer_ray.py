"""``ray``: a Ray actor receiving the arrays as ``.remote()`` arguments, at most ``in_flight``
calls pending; sender and receiver are Ray actors, started by Ray (one local instance per run,
closed by :func:`ray_shutdown`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from rlink_ucx.bench.common import SOURCE_ROOT
from rlink_ucx.bench.measure import Recorder, Timing, per_gb
from rlink_ucx.bench.workloads import Workload

_RAY: dict[str, Any] = {}


def _ray() -> tuple[Any, Any, Any]:
    """Start a local Ray instance once (closed by :func:`ray_shutdown`); its actor classes."""
    if not _RAY:
        import logging

        import ray

        # Ray's worker processes import this module by name (bench/) and the rlink_ucx it uses.
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        mine = [p for p in (SOURCE_ROOT, os.path.dirname(os.path.abspath(__file__))) if p not in paths]
        os.environ["PYTHONPATH"] = os.pathsep.join([*mine, *paths])
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=False)  # fmt: skip
        _RAY["ray"] = ray
        _RAY["receiver"] = ray.remote(num_cpus=0)(RayReceiver)
        _RAY["sender"] = ray.remote(num_cpus=0)(RaySender)
    return _RAY["ray"], _RAY["receiver"], _RAY["sender"]


def ray_shutdown() -> None:
    if _RAY:
        _RAY.pop("ray").shutdown()
        _RAY.clear()


class RayReceiver:
    """A Ray actor: each ``push(t_ns, *fields)`` call is one message."""

    def __init__(self) -> None:
        self.rec = Recorder()
        self.cpu0: float | None = None
        self.cpu = 0.0

    def push(self, t_ns: np.ndarray, *fields: np.ndarray) -> None:
        now = time.monotonic_ns()
        if self.cpu0 is None:
            self.cpu0 = time.process_time()
        self.rec.add(now, len(t_ns), now - int(t_ns[0]))
        self.cpu = time.process_time() - self.cpu0

    def report(self) -> tuple[list[int], list[int], list[Any], float]:
        return self.rec.t, self.rec.n, self.rec.lat, self.cpu


class RaySender:
    """A Ray actor that calls ``receiver.push.remote`` with at most ``in_flight`` calls pending."""

    def run(self, receiver: Any, workload: Workload, seconds: float, in_flight: int, timeout: float) -> dict[str, Any]:
        import ray

        arrays = list(workload.chunk_arrays().values())
        pending: list[Any] = []
        messages = 0
        cpu0 = time.process_time()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t_ns = np.full(workload.chunk, time.monotonic_ns(), np.int64)
            pending.append(receiver.push.remote(t_ns, *arrays))
            messages += 1
            if len(pending) >= in_flight:
                ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
                if not ready:
                    raise TimeoutError(f"no push completed within {timeout}s")
                ray.get(ready)
        ray.get(pending, timeout=timeout)
        return {"cpu_s": time.process_time() - cpu0, "bytes": messages * workload.chunk * workload.size_bytes}


def run_ray(workload: Workload, timing: Timing, in_flight: int = 8) -> dict[str, Any]:
    ray, receiver_cls, sender_cls = _ray()
    receiver = receiver_cls.remote()
    sender = sender_cls.remote()
    try:
        sent = ray.get(sender.run.remote(receiver, workload, timing.stream_seconds, in_flight, timing.timeout),
                       timeout=timing.stream_seconds + 2 * timing.timeout)  # fmt: skip
        t, n, lat, cpu = ray.get(receiver.report.remote(), timeout=timing.timeout)
    finally:
        for actor in (sender, receiver):
            ray.kill(actor)
    rec = Recorder()
    rec.t, rec.n, rec.lat = t, n, lat
    out = rec.result(timing, workload.size_bytes)
    out["cpu_s_per_gb_send"] = per_gb(sent["cpu_s"], sent["bytes"])
    out["cpu_s_per_gb_recv"] = per_gb(cpu, rec.steps * workload.size_bytes)
    return out

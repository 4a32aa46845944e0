"""From arrival times to a row: the timing of a row, the per-message recorder, the record.

The first ``Timing.warmup`` seconds after the first arrival are dropped and the next
``Timing.reps`` windows of ``Timing.window`` seconds are the repetitions; ``merge_rounds``
pools the windows of several rounds of one row.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np

from .workloads import Workload


@dataclasses.dataclass(frozen=True)
class Timing:
    warmup: float = 0.5  # seconds dropped after the first arrival
    window: float = 0.6  # seconds per repetition
    reps: int = 3
    timeout: float = 60.0  # any single wait

    @property
    def measured(self) -> float:
        return self.warmup + self.reps * self.window

    @property
    def stream_seconds(self) -> float:
        """How long senders send: the measured span plus a tail for the first message's delay."""
        return self.measured + max(0.25, 0.1 * self.measured)


class Recorder:
    """Per message: arrival (ns), steps, and latency (ns; a scalar or one value per step)."""

    def __init__(self) -> None:
        self.t: list[int] = []
        self.n: list[int] = []
        self.lat: list[Any] = []

    def add(self, now_ns: int, steps: int, lat_ns: Any) -> None:
        self.t.append(now_ns)
        self.n.append(steps)
        self.lat.append(lat_ns)

    def stamp(self, now_ns: int, steps: int, sent_ns: int) -> int:
        """Record a message sent at ``sent_ns``; 1 if it is the sender's end marker (negative)."""
        if sent_ns < 0:
            return 1
        self.add(now_ns, steps, now_ns - sent_ns)
        return 0

    @property
    def steps(self) -> int:
        return sum(self.n)

    def result(self, timing: Timing, step_bytes: int) -> dict[str, Any]:
        if len(self.t) < 2:
            raise RuntimeError(f"only {len(self.t)} message(s) arrived; nothing to measure")
        t = np.asarray(self.t, np.int64)
        n = np.asarray(self.n, np.int64)
        start = t[0] + int(timing.warmup * 1e9)
        span = int(timing.window * 1e9)
        rates = []
        for i in range(timing.reps):
            lo, hi = np.searchsorted(t, [start + i * span, start + (i + 1) * span])
            if hi <= lo:
                continue
            # the steps that arrived in the window, over the time since the arrival just before it
            # (exact for a steady stream, even when a window holds a single big message or batch)
            ref, first = (lo - 1, lo) if lo > 0 else (lo, lo + 1)
            if hi > first and t[hi - 1] > t[ref]:
                rates.append(float(n[first:hi].sum()) / float((t[hi - 1] - t[ref]) / 1e9))
        coarse = not rates
        if coarse:  # fewer messages than windows (a very slow system): one rate over the whole stream
            rates.append(float(n[1:].sum()) / float((t[-1] - t[0]) / 1e9))
        lo, hi = np.searchsorted(t, [start, start + timing.reps * span])
        picked = self.lat[lo:hi] or self.lat[-1:]
        if isinstance(picked[0], np.ndarray):
            lat = np.concatenate(picked)
        else:
            lat = np.asarray(picked, np.float64)
        p50, p99 = np.percentile(lat, [50, 99]) / 1e3
        gbps = [r * step_bytes / 1e9 for r in rates]
        out = {
            "gbps": statistics.median(gbps), "gbps_min": min(gbps), "gbps_max": max(gbps),
            "per_s": statistics.median(rates), "p50_us": float(p50), "p99_us": float(p99), "reps": len(rates),
            "windows": rates,  # steps/s of each repetition
        }  # fmt: skip
        if coarse:
            out["coarse"] = f"{len(t)} messages in all: one rate over the whole stream"
        return out


def record(system: str, transport: str, workload: Workload, actors: int, group: str, **values: Any) -> dict[str, Any]:
    rec = {"system": system, "transport": transport, "workload": workload.name, "size_bytes": workload.size_bytes,
           "actors": actors, "gbps": None, "per_s": None, "p50_us": None, "p99_us": None, "reps": 0,
           "group": group, "chunk": workload.chunk}  # fmt: skip
    rec.update(values)
    return rec


def per_gb(cpu_s: float | None, nbytes: int) -> float | None:
    return None if cpu_s is None or nbytes <= 0 else cpu_s / (nbytes / 1e9)


def merge_rounds(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the rounds of one row: the windows of every round pooled."""
    ok = [r for r in recs if r.get("windows")]
    if len(recs) == 1 or not ok:
        return recs[0]
    out = dict(ok[0])
    windows = [w for r in ok for w in r["windows"]]
    scale = out["size_bytes"] / 1e9
    out.update(windows=windows, reps=len(windows), per_s=statistics.median(windows),
               gbps=statistics.median(windows) * scale, gbps_min=min(windows) * scale, gbps_max=max(windows) * scale,
               p50_us=statistics.median(r["p50_us"] for r in ok), p99_us=statistics.median(r["p99_us"] for r in ok),
               rounds=len(ok))  # fmt: skip
    for key in ("cpu_s_per_gb_send", "cpu_s_per_gb_recv"):
        values = [r[key] for r in ok if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    failed = [r.get("error") or r.get("skipped") for r in recs if not r.get("windows")]
    if failed:
        out["failed_rounds"] = failed
    return out

"""The soak's per-minute analysis (bench/soak_report.py): minutes, slopes, and the p99 drift
measured outside a learner restart's outage."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from bench import soak_report as soak_scale

pytestmark = pytest.mark.timeout(30)


def minute(m: int, p99: float, learner: int, rss: float = 100.0, fds: int = 600) -> dict:
    return {"minute": m, "p99_ms": p99, "learner": learner, "rss_mib": rss, "fds": fds}


def test_samples_fall_into_their_minute_with_its_percentiles_and_events():
    samples = [{"time": 10.0 + t, "rss_mib": 100.0 + t, "fds": 600, "threads": 9, "learner": 0, "load": t / 10,
                "lat_ms": np.full(100, 1.0 + t), "others": t / 100, "gc_max_ms": t / 10, "learner_cpu": t / 100}
               for t in (0.0, 30.0, 65.0)]  # fmt: skip
    samples[1]["top_others"] = [("cc1", 0.3)]
    rows = soak_scale.per_minute(samples, 10.0, [(20.0, "kill"), (61.0, "kill"), (70.0, "restart")])
    assert [r["minute"] for r in rows] == [1, 2]
    assert rows[0]["steps"] == 200 and rows[0]["p50_ms"] == 16.0 and rows[0]["rss_mib"] == 130.0
    assert rows[0]["load"] == 3.0 and rows[1]["load"] == 6.5  # the highest load average of the minute
    assert rows[0]["others"] == 0.3 and rows[0]["gc_max_ms"] == 3.0  # the minute's highest
    assert rows[0]["top_others"] == [("cc1", 0.3)] and rows[1]["top_others"] == []  # of the busiest sample
    assert rows[0]["learner_cpu"] == 0.15 and rows[1]["learner_cpu"] == 0.65  # the minute's mean
    assert rows[1]["steps"] == 100 and rows[1]["p99_ms"] == 66.0 and rows[1]["events"] == 2


def test_the_restart_minute_and_the_next_are_left_out_of_the_drift_and_nothing_else():
    minutes = [minute(1, 10, 0), minute(2, 12, 0), minute(3, 900, 1), minute(4, 300, 1), minute(5, 15, 1),
               minute(6, 11, 1)]  # fmt: skip
    slopes = soak_scale.resource_slopes(minutes)
    assert slopes["p99_max_over_first"] == 90.0
    assert slopes["p99_max_over_first_outside_restarts"] == 1.5  # 15 ms in minute 5 over 10 ms
    assert slopes["rss_pct_per_10min"] is None  # fewer than two minutes after the fifth


def test_resource_slopes_are_percent_of_minute_six_per_ten_minutes():
    minutes = [minute(m, 10, 0, rss=100.0 + (m - 6) * 1.0, fds=600) for m in range(1, 21)]
    slopes = soak_scale.resource_slopes(minutes)
    assert slopes["rss_pct_per_10min"] == 10.0  # 1 MiB a minute from 100 MiB
    assert slopes["fds_pct_per_10min"] == 0.0
    assert slopes["p99_max_over_first_outside_restarts"] == 1.0

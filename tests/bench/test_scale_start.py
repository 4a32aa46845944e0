"""The scale benchmark's two start modes at a tiny size: ``--start together`` (all released at
once, schema inferred from the first put, lockstep) reports whole-run, first-step and steady
percentiles and the time to connect all, with every step delivered once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlink_ucx.bench.scale_worker import next_due

ROOT = Path(__file__).resolve().parents[2]


def test_lockstep_pacing_skips_the_grid_points_a_late_actor_missed():
    # together: on the grid start + k * period; spread: one period on, late or not (it catches up)
    assert next_due(10.0, 0.5, 10.0, 10.1, together=True) == 10.5
    assert next_due(10.0, 0.5, 10.0, 11.7, together=True) == 12.0
    assert next_due(10.0, 0.5, 10.0, 11.7, together=False) == 10.5


@pytest.mark.timeout(150)
def test_start_together_reports_first_step_steady_and_connect_time(tmp_path):
    out = tmp_path / "scale.json"
    args = ["-m", "rlink_ucx", "bench", "--suite", "scale", "--actors", "6", "--procs", "2", "--seconds", "4",
            "--rate", "25", "--transport", "tcp", "--start", "together", "--timeout", "60", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=140)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["args"]["start"] == "together"
    (r,) = report["rows"]
    assert r["error"] is None and r["start"] == "together", r["error"]
    assert r["connected"] == 6 and r["connect_failed"] == 0 and r["died"] == 0, r["errors"]
    # connected after the release, within the run; every actor put 25 steps/s for the 4 s from the release
    assert 0 < r["connect_s"] < 4
    assert 6 * 90 <= r["expected"] <= 6 * 101, r["expected"]
    assert r["delivered"] == r["received"] == r["expected"] and r["duplicated"] == r["lost"] == 0
    assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    # seq 0 of each of the 6 actors: its connect's schema negotiation is part of that put
    assert 0 < r["first_p50_ms"] <= r["first_p99_ms"] <= r["first_max_ms"] <= r["max_ms"]
    assert 0 <= r["first_over_200ms"] <= 6
    # counted from the release: it includes connecting
    assert 0 < r["first_fetched_p50_s"] <= r["first_fetched_p99_s"] <= r["first_fetched_max_s"] < 4
    # steps put from 3 s after the release on: about 1 s of 6 actors at 25 steps/s
    assert 6 * 20 <= r["steady_steps"] <= 6 * 27, r["steady_steps"]
    assert 0 < r["steady_p50_ms"] <= r["steady_p99_ms"] <= r["max_ms"]
    # measured once the last actor connected: each holds a control and a data connection
    assert r["learner_fds"] >= r["learner_fds_before"] + 2 * 6 and r["learner_rss_after_mib"] > 0
    text = done.stdout
    for header in ("1st_p50", "1st_p99", "st_p50", "st_p99", "conn_s", "together"):
        assert header in text, header

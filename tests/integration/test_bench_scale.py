"""The scale benchmark (many actors into one learner) runs end to end at a tiny size and reports
real values: every step delivered once, latencies ordered, the learner's CPU and memory measured."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.timeout(150)
def test_scale_bench_delivers_every_step_once_and_measures_the_learner(tmp_path):
    from rlink_ucx.transport.shm import channel as shm
    transports = "tcp,shm" if shm.available() else "tcp"
    out = tmp_path / "scale.json"
    args = ["-m", "rlink_ucx", "bench", "--suite", "scale", "--actors", "1,4", "--procs", "2", "--seconds", "2",
            "--rate", "50", "--transport", transports, "--timeout", "60", "--json", str(out)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *args], check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=140
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["transport"], r["actors"]) for r in rows] == [(t, n) for t in transports.split(",") for n in (1, 4)]
    for r in rows:
        label = f"{r['transport']} x{r['actors']}"
        assert r["error"] is None, (label, r["error"])
        assert r["connected"] == r["actors"] and r["connect_failed"] == 0 and r["died"] == 0, (label, r["errors"])
        assert r["procs"] == min(2, r["actors"])
        assert r["planes"] == {r["transport"]: r["actors"]}, label
        # 50 steps/s for 2 s per actor, give or take a step at the edges of the window
        assert 95 * r["actors"] <= r["expected"] <= 105 * r["actors"], (label, r["expected"])
        assert r["delivered"] == r["expected"] and r["received"] == r["expected"], label
        assert r["duplicated"] == 0 and r["lost"] == 0 and r["unexpected"] == 0, label
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"] <= r["max_ms"] < 10_000, label
        assert r["learner_cpu"] > 0 and r["actor_cpu_per_actor"] > 0, label
        assert r["connect_s"] > 0, label
        assert r["learner_rss_after_mib"] > 0 and r["learner_fds"] > r["learner_fds_before"] > 0, label
    text = done.stdout
    assert "p99.9_ms" in text and "lrn_cpu" in text


def test_scale_suite_help_lists_its_options():
    done = subprocess.run([sys.executable, "-m", "rlink_ucx", "bench", "--suite", "scale", "--help"], check=False,
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for option in ("--actors", "--procs", "--rate", "--seconds", "--transport", "--timeout", "--json", "--plot"):
        assert option in done.stdout

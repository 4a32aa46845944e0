"""`rlink demo --quick` end to end: real learner, real actor processes, real env, real files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("gymnasium", reason="the demo extra is not installed")


def run_demo(tmp_path, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "rlink_ucx", "demo", "--quick", "--plain", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=150)  # fmt: skip
    assert proc.returncode in (0, 2), proc.stdout[-2000:] + proc.stderr[-4000:]
    png = (out / "learning_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    return proc.returncode, json.loads((out / "summary.json").read_text()), proc.stdout


def brief(summary: dict) -> dict:
    """What explains a demo that did not learn (pytest truncates the whole summary)."""
    keys = ("outcome", "final_mean_return_100", "random_policy_return", "updates", "model_version", "total_env_steps",
            "steps_per_second", "staleness_mean", "staleness_max", "lost_actors", "transport")  # fmt: skip
    return {k: summary.get(k) for k in keys}


def check_accounting(summary: dict) -> None:
    assert summary["total_env_steps"] > 0
    assert summary["total_env_steps"] == summary["env_steps_reported_by_actors"] + summary["env_steps_from_lost_actors"]
    assert summary["steps_per_second"] > 0 and summary["bytes_moved"] > 0
    assert summary["weights"]["published"] == summary["model_version"] >= summary["updates"]


@pytest.mark.timeout(200)
def test_quick_demo_learns_and_writes_a_consistent_summary(tmp_path):
    rc, summary, stdout = run_demo(tmp_path, "--transport", "tcp")
    check_accounting(summary)
    assert summary["transport"] == "tcp" and summary["config"]["quick"] is True
    assert summary["actors_reported"] == summary["actors_started"] == 2 and summary["lost_actors"] == []
    assert summary["final_mean_return_100"] > 2 * summary["random_policy_return"], brief(summary)
    assert summary["target_reached"] == (rc == 0)
    assert summary["weights"]["fanouts"] > 0 and summary["staleness_max"] >= summary["staleness_mean"] >= 0
    assert "[rlink demo]" in stdout


@pytest.mark.timeout(200)
def test_killing_one_actor_leaves_the_demo_running_and_is_recorded(tmp_path):
    rc, summary, _ = run_demo(tmp_path, "--actors", "3", "--kill-one-actor-after", "0.5", "--max-seconds", "45")
    check_accounting(summary)
    killed = summary["killed_on_purpose"]
    assert killed is not None
    assert [a["pid"] for a in summary["lost_actors"]] == [killed["pid"]]
    assert summary["actors_reported"] == 2
    assert summary["outcome"] in ("target reached", "time limit")
    assert summary["final_mean_return_100"] > 2 * summary["random_policy_return"], brief(summary)

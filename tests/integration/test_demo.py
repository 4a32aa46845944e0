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


def check_ranks(tmp_path, summary: dict, world: int) -> list[dict]:
    """Every rank trained on steps of actors of its own, in lockstep, and kept the same model."""
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world)), ranks
    actors = [set(r["actors"]) for r in ranks]
    assert all(actors) and sum(map(len, actors)) == len(set().union(*actors)), ranks  # each actor at one rank
    assert len(set().union(*actors)) == summary["actors_started"], ranks
    assert all(r["env_steps"] > 0 for r in ranks) and sum(r["env_steps"] for r in ranks) == summary["total_env_steps"]
    assert len({r["address"] for r in ranks}) == world
    files = [json.loads((tmp_path / "demo" / f"rank{r}.json").read_text()) for r in range(world)]
    assert [f["world_size"] for f in files] == [world] * world
    assert {f["updates"] for f in files} == {summary["updates"]}  # every update taken by every rank
    assert {f["version"] for f in files} == {summary["model_version"]}
    assert len({f["parameter_sum"] for f in files}) == 1, files  # DDP kept the replicas identical
    assert {f["batch_per_rank"] for f in files} == {16 // world}
    return files


@pytest.mark.timeout(200)
def test_quick_demo_with_two_learner_ranks_trains_one_model_with_ddp(tmp_path):
    rc, summary, stdout = run_demo(tmp_path, "--transport", "tcp", "--learners", "2")
    check_accounting(summary)
    assert summary["actors_reported"] == summary["actors_started"] == 2 and summary["lost_actors"] == []
    check_ranks(tmp_path, summary, 2)
    assert summary["final_mean_return_100"] > 2 * summary["random_policy_return"], brief(summary)
    assert summary["target_reached"] == (rc == 0)
    assert "[rlink demo]" in stdout


@pytest.mark.slow  # the full target, as the single-learner demo's: 20-300 s on 2 shared cores
@pytest.mark.timeout(420)
def test_demo_with_two_learner_ranks_reaches_the_full_target(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "rlink_ucx", "demo", "--learners", "2", "--plain", "--transport", "tcp",
                           "--out", str(out)], capture_output=True, text=True, timeout=400)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0 and summary["target_reached"], brief(summary)
    assert summary["final_mean_return_100"] >= 475
    check_accounting(summary)
    check_ranks(tmp_path, summary, 2)


@pytest.mark.timeout(60)
def test_more_learner_ranks_than_actors_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlink_ucx", "demo", "--learners", "3", "--actors", "2", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--actors must be at least --learners" in proc.stderr

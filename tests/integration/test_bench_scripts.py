"""The throughput scripts under bench/ run end to end (small sizes) and print real numbers."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
                          check=False)
    if ok:
        assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_throughput_measures_the_raw_socket_and_the_tcp_plane(tmp_path):
    out = tmp_path / "tp.json"
    _run("bench/throughput.py", "--sizes", "1K", "--transports", "tcp", "--reps", "1", "--steps", "20000",
         "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    assert report["machine"]["device"] == "cpu"
    rows = {(r["workload"], r["system"]): r for r in report["rows"]}
    assert set(rows) == {("bytes-1K", "raw-socket"), ("bytes-1K", "rlink-tcp"), ("cartpole-put", "rlink-tcp"),
                         ("cartpole-put_many", "rlink-tcp")}  # fmt: skip
    assert rows[("bytes-1K", "raw-socket")]["ratio"] == 1.0
    for row in rows.values():
        assert row["min"] <= row["median"] <= row["max"] and row["median"] > 0


def test_tcp_ab_alternates_variants_against_the_raw_socket():
    text = _run("bench/tcp_ab.py", "--size", "1K", "--rounds", "2", "--variant", "", "--variant",
                "RLINK_FRAME_BYTES=65536").stdout  # fmt: skip
    lines = {line.split("  ")[0].strip(): line for line in text.splitlines() if "GB/s" in line}
    assert set(lines) == {"raw-socket", "raw-socket reno", "rlink-tcp (defaults)", "rlink-tcp RLINK_FRAME_BYTES=65536"}
    for line in lines.values():
        median, rounds = re.search(r"([\d.]+) GB/s .*x\s+(.*)$", line).groups()
        assert float(median) > 0 and len(rounds.split()) == 2


def test_throughput_on_a_gpu_that_is_not_there_fails_with_a_clear_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: ci/gpu-check.sh runs the GPU benchmark there")
    done = _run("bench/throughput.py", "--device", "cuda:0", "--sizes", "1K", "--transports", "tcp", "--reps", "1",
                ok=False)  # fmt: skip
    assert done.returncode != 0
    assert "device cuda:0 requested but CUDA is not available" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_bridge_ab_measures_both_systems_across_two_namespaces():
    text = _run("bench/bridge_ab.py", "--size", "1K", "--rounds", "1").stdout
    rows = {line.split("  ")[0].strip(): line for line in text.splitlines() if "GB/s" in line}
    assert set(rows) == {"raw-socket (system default)", "raw-socket reno", "rlink-tcp (defaults)",
                         "rlink-tcp RLINK_TCP_CONGESTION=reno"}  # fmt: skip
    for line in rows.values():
        assert float(re.search(r"([\d.]+) GB/s", line).group(1)) > 0


def test_actor_cpu_measures_an_idle_and_a_putting_actor(tmp_path):
    out = tmp_path / "cpu.json"
    _run("bench/actor_cpu.py", "--transport", "tcp", "--rate", "0,50", "--seconds", "1", "--settle", "0.2",
         "--reps", "1", "--json", str(out))  # fmt: skip
    rows = {row["rate"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {0.0, 50.0}
    for row in rows.values():
        assert row["transport"] == "tcp" and row["lost"] == 0
        assert 0 < row["cpu_pct"] < 100 and row["wakeups_per_s"] > 0
    assert rows[0.0]["frames_sent"] == 0 and rows[0.0]["put_us_median"] is None
    assert rows[50.0]["runs"][0]["puts"] == 50 and rows[50.0]["runs"][0]["received"] == 51


def test_the_soak_kills_pauses_and_cuts_and_every_stream_still_balances(tmp_path):
    # Its actors dial fault proxies, not the learner's port: they must be told the learner's
    # generated token (they looked it up under the proxy's port and failed with AuthError).
    # Seed 2034 draws a learner pause (2.5 s), an actor kill and a link cut (2.4 s) within the
    # 12 s: the pause and the cut outlast the soak's 1.5 s heartbeat timeout. (Seed 1 drew two
    # kills and two pauses in 0.3 minutes, and no cut.)
    out = tmp_path / "soak.json"
    done = _run("bench/soak.py", "--minutes", "0.2", "--seed", "2034", "--transport", "tcp", "--json", str(out),
                ok=False)  # fmt: skip
    assert "AuthError" not in done.stderr, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {e.split()[0] for _, e in report["events"]} == {"kill", "pause", "cut"}, report["events"]
    streams = report["streams"]
    assert streams and all(r["balanced"] for r in streams), streams
    assert report["order_errors"] == [] and sum(r["delivered"] for r in streams) > 1000


def test_many_learners_compares_one_rank_with_two_on_the_same_actors(tmp_path):
    out = tmp_path / "ml.json"
    _run("bench/many_learners.py", "--ranks", "2", "--actors", "2", "--seconds", "1.5", "--repeats", "1",
         "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    one, two = report["runs"]["1"][0], report["runs"]["2"][0]
    assert [r["rank"] for r in one["per_rank"]] == [0] and [r["rank"] for r in two["per_rank"]] == [0, 1]
    for run in (one, two):
        assert run["gb_per_s"] > 0 and abs(sum(r["gb_per_s"] for r in run["per_rank"]) - run["gb_per_s"]) < 1e-9
        assert all(r["gb_per_s"] > 0 and r["cpu_s_per_gb"] > 0 for r in run["per_rank"]), run  # every rank ingests
    assert report["ratio"] == report["many"] / report["one"]


@pytest.mark.timeout(200)
def test_the_soak_at_scale_kills_actor_processes_and_the_learner_and_every_step_is_accounted_for(tmp_path):
    # The CI size of the hour-long soak (docs/reliability.md): 64 actors over 4 processes for
    # 1 minute, an actor process SIGKILLed every 18 s, the learner killed and restarted once (at
    # 30 s). A minute, so that a slow 2-vCPU machine stays well inside the per-test budget and
    # the stack dump that pytest prints after faulthandler_timeout (110 s).
    out = tmp_path / "soak_scale.json"
    done = _run("bench/soak.py", "--actors", "64", "--procs", "4", "--minutes", "1", "--kill-every", "18",
                "--learner-restarts", "1", "--transport", "tcp", "--json", str(out), ok=False)  # fmt: skip
    assert out.exists(), (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads(out.read_text())
    assert done.returncode == 0 and report["ok"], (done.stdout[-3000:], done.stderr[-2000:])
    kills = [e for _, e in report["events"] if e.startswith("actor process")]
    restarts = [e for _, e in report["events"] if e.startswith("learner killed")]
    assert len(kills) == 3 and len(restarts) == 1, report["events"]  # at 18, 36 and 54 s
    t = report["totals"]
    # 64 streams, and 16 more for each killed process of 16 actors
    assert report["streams"] == 64 + 3 * 16 and report["unbalanced"] == [] and report["actor_errors"] == []
    assert t["put"] == t["delivered"] + t["reported_lost"] + t["lost_in_kill"] + t["lost_at_learner_restart"]
    assert t["delivered"] > 64 * 5 * 30  # 5 steps/s each: most of the minute's steps arrived
    minutes = report["minutes"]
    assert [m["minute"] for m in minutes] == [1]
    for m in minutes:
        assert m["rss_mib"] > 0 and m["fds"] > 64 and m["threads"] > 0 and 0 < m["p50_ms"] <= m["p99_ms"], m
    assert "minute  rss_MiB  fds  threads" in done.stdout and "learner killed and restarted" in done.stdout


def test_small_frames_measures_landing_against_begin_copy_end(tmp_path):
    out = tmp_path / "sf.json"
    _run("bench/small_frames.py", "--frames", "3000", "--per-read", "1,8", "--rounds", "1", "--json", str(out))
    report = json.loads(out.read_text())
    rows = {(r["per_read"], r["variant"]): r for r in report["rows"]}
    assert set(rows) == {(n, v) for n in (1, 8) for v in ("begin", "land", "burst")}
    for (per_read, variant), row in rows.items():
        assert row["us_per_frame"] > 0 and row["min"] <= row["us_per_frame"] <= row["max"]
        assert row["ratio"] == 1.0 if variant == "begin" else row["ratio"] > 0


def test_burst_receive_measures_the_learners_receive_path_per_frame(tmp_path):
    out = tmp_path / "burst.json"
    _run("bench/burst_receive.py", "--connections", "64", "--bursts", "5", "--period", "0.2", "--per-pump", "16",
         "--json", str(out))  # fmt: skip
    report = json.loads(out.read_text())
    assert report["frames"] == 64 * 3  # the bursts after the 2 warm-up ones, every frame taken
    assert report["pumps"] == 1  # small-frame connections share one pump
    assert report["cpu_us_per_frame"] > 0
    assert report["pumps_us_per_frame"] > 0 and report["consumer_us_per_frame"] > 0  # by thread, from /proc
    assert report["consumer"] == "dataset" and report["batch"] == 256 and report["frames_per_s"] > 0
    # The pumps' CPU split into reading and landing (thread clocks around each pass): within theirs.
    assert 0 < report["read_us_per_frame"] and 0 < report["land_us_per_frame"]
    assert report["read_us_per_frame"] + report["land_us_per_frame"] <= report["pumps_us_per_frame"] * 1.1 + 1
    assert report["polls_per_burst"] >= 1 and 1 <= report["frames_per_pass"] <= 64
    p50, p90, p99 = report["latency_ms_p50_p90_p99"]
    assert 0 < p50 <= p90 <= p99


def test_mac_speed_measures_the_bucket_tags(tmp_path):
    out = tmp_path / "mac.json"
    text = _run("bench/mac_speed.py", "--mb", "3", "--bucket-mb", "1", "--reps", "3", "--json", str(out)).stdout
    report = json.loads(out.read_text())
    assert report["bytes"] == 3 << 20 and report["buckets"] == 3 and report["cores"] >= 1
    assert 0 < report["min_s"] <= report["median_s"] and report["gb_per_s"] == pytest.approx(report["bytes"] / report["median_s"] / 1e9)
    assert set(report["cpu"]["flags"]) >= {"aes", "pclmulqdq", "avx512_vnni"} and not report["torch"]
    assert "tags of 3 MiB in 3 bucket(s)" in text and "GB/s" in text

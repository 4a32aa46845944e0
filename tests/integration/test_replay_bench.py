"""The replay suite (`rlink bench --suite replay`) runs end to end at small sizes and reports real numbers."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_replay_bench_quick_reports_every_measure(tmp_path):
    out = tmp_path / "replay.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # --quick with the smaller sizes the device-table test below uses: every measure still runs
    # and reports (what this test checks), in about half the time of --quick's own sizes.
    done = subprocess.run([sys.executable, "-m", "rlink_ucx", "bench", "--suite", "replay", "--quick",
                           "--atari-capacity", "600", "--capacity", "5000", "--ckpt-gb", "0.04", "--seconds", "0.5",
                           "--prioritized-reps", "50", "--ckpt-dir", str(tmp_path), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["uniform"]["batch"] == 256 and report["uniform"]["batches_per_s"] > 0
    assert 0 < report["prioritized"]["sum_tree_ms"] <= report["prioritized"]["ms_per_sample_update"]
    assert {row["workload"] for row in report["insert"]} == {"small", "atari"}
    for row in report["insert"]:
        assert row["replay_steps_per_s"] > 0 and row["rlinkdataset_steps_per_s"] > 0 and row["ratio"] > 0
    ckpt = report["checkpoint"]
    assert ckpt["files_gb"] >= ckpt["table_gb"] > 0
    assert all(v > 0 for k in ("save", "load", "disk_write", "disk_read") for v in ckpt["runs_gb_s"][k])
    assert not list(tmp_path.glob("rlink-replay-bench-*")), "the benchmark left its files behind"


@pytest.mark.timeout(240)
def test_rlink_bench_suite_replay_reports_sane_numbers_with_a_device_table(tmp_path):
    """`rlink bench --suite replay` (the CLI, tiny sizes, the table as torch tensors on the CPU)."""
    out = tmp_path / "suite.json"
    done = subprocess.run([sys.executable, "-m", "rlink_ucx", "bench", "--suite", "replay", "--quick", "--storage", "device",
                           "--atari-capacity", "600", "--capacity", "5000", "--ckpt-gb", "0.04", "--seconds", "0.5",
                           "--prioritized-reps", "50", "--ckpt-dir", str(tmp_path), "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=220, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"machine", "uniform", "prioritized", "insert", "checkpoint"}
    u = report["uniform"]
    assert (u["capacity"], u["batch"], u["storage"], u["device"]) == (600, 256, "device", "cpu")
    assert 0 < u["batches_per_s"] < 1e6 and u["items_per_s"] == pytest.approx(256 * u["batches_per_s"], rel=1e-3)
    assert u["gb_per_s"] == pytest.approx(u["items_per_s"] * 28237 / 1e9, abs=0.01)
    p = report["prioritized"]
    assert p["capacity"] == 5000 and 0 < p["sum_tree_ms"] <= p["ms_per_sample_update"] <= p["p90_ms"] < 1000
    for row in report["insert"]:
        assert 0 < row["replay_steps_per_s"] < 1e9 and 0 < row["rlinkdataset_steps_per_s"] < 1e9
        assert row["ratio"] == pytest.approx(row["replay_steps_per_s"] / row["rlinkdataset_steps_per_s"], rel=1e-2)
    c = report["checkpoint"]
    assert c["storage"] == "device" and c["reps"] == 1 and c["files_gb"] >= c["table_gb"] > 0
    for measure in ("save", "load", "disk_write", "disk_read"):
        assert len(c["runs_gb_s"][measure]) == 1 and 0 < c[f"{measure}_gb_s"] < 1000
    assert c["save_vs_disk"] == pytest.approx(c["save_gb_s"] / c["disk_write_gb_s"], rel=0.06, abs=0.006)
    assert c["load_vs_disk"] == pytest.approx(c["load_gb_s"] / c["disk_read_gb_s"], rel=0.06, abs=0.006)
    # a plain write of the table's size cannot be 10x faster than memory: it wrote every byte
    assert c["disk_write_gb_s"] < 100 and c["disk_read_gb_s"] < 100
    for kind in ("write", "read"):  # O_DIRECT: measured, or None where the file system refuses it
        assert c[f"direct_{kind}_gb_s"] is None or 0 < c[f"direct_{kind}_gb_s"] < 100
    assert not list(tmp_path.glob("rlink-replay-bench-*")), "the benchmark left its files behind"
    assert "uniform B=256 Atari (device table, batches on cpu)" in done.stderr

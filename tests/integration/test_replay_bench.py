"""bench/replay.py runs end to end at small sizes and reports real numbers."""

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
    done = subprocess.run([sys.executable, "bench/replay.py", "--quick", "--ckpt-dir", str(tmp_path), "--json", str(out)],
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

"""The micro benchmarks (test_micro.py, marked slow: a timed run) keep working in the default
run: each runs once, its checks included."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_every_micro_benchmark_runs_and_checks_its_result():
    pytest.importorskip("pytest_benchmark", reason="the test extra installs pytest-benchmark")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "bench" / "test_micro.py"), "-q",
                           "-p", "no:cacheprovider", "-m", "slow", "--benchmark-disable"],
                          capture_output=True, text=True, timeout=110, env=env, cwd=ROOT, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    want = "7 passed" if sys.platform.startswith("linux") else "5 passed, 2 skipped"  # shm and cma are Linux
    assert want in proc.stdout, proc.stdout[-500:]

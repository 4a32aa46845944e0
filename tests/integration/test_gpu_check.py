"""ci/gpu-check.sh and the two benchmarks it adds, run for real on a machine without a GPU:
bench/ucx_d2d.py on host memory (ucxx over TCP loopback), bench/gpu_latency.py on the CPU, and
the check itself, which must say "no CUDA", leave well-formed files and exit 0 here, and fail
loudly where a GPU is seen but the GPU tests skip."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = ["wheels", "env", "gpu-tests", "gpu-throughput", "ucx-d2d", "gpu-latency", "host-latency", "fanout",
         "replay-device"]
STATUSES = {"ok", "failed", "timed out", "skipped-no-cuda", "skipped"}
torch = pytest.importorskip("torch")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: ci/gpu-check.sh measures it")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # The check calls python3: make it this interpreter (the virtualenv's).
    first = [extra.pop("PREPEND")] if "PREPEND" in extra else []
    env["PATH"] = os.pathsep.join([*first, os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(extra)
    return env


def _script(*args: str, timeout: float = 50) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], check=False, cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.timeout(60)
def test_ucx_d2d_host_memory_measures_every_size(tmp_path):
    pytest.importorskip("ucxx")
    out = tmp_path / "d2d.json"
    done = _script("bench/ucx_d2d.py", "--host-memory", "--sizes", "64K,1M", "--reps", "2", "--total-mib", "16",
                   "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["memory"] == "host" and report["ucx_tls"] == "tcp" and "error" not in report
    assert [r["size"] for r in report["rows"]] == ["64K", "1M"]
    for row in report["rows"]:
        assert row["gbps"] > 0 and row["gbps_min"] <= row["gbps"] <= row["gbps_max"]
        assert len(row["reps"]) == 2 and row["messages"] == max(20, (16 << 20) // row["bytes"])


@no_cuda
@pytest.mark.timeout(60)
def test_the_cuda_benchmarks_without_cuda_exit_3_with_one_line_and_a_json(tmp_path):
    for script, device in (("bench/ucx_d2d.py", "cuda:0"), ("bench/gpu_latency.py", "cuda:0")):
        out = tmp_path / "out.json"
        done = _script(script, "--device", device, "--json", str(out))
        assert done.returncode == 3, (script, done.stderr[-3000:])
        assert "Traceback" not in done.stderr and "no CUDA" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        report = json.loads(out.read_text())
        assert report["cuda"] is False and report["rows"] == [] and "no CUDA" in report["error"]


@pytest.mark.timeout(60)
def test_gpu_latency_on_the_cpu_counts_every_step_sent(tmp_path):
    transports = ["auto", "tcp", "shm"] + (["ucx"] if importlib.util.find_spec("ucxx") else [])
    out = tmp_path / "lat.json"
    done = _script("bench/gpu_latency.py", "--device", "cpu", "--transport", ",".join(transports), "--chunks", "40",
                   "--chunk", "16", "--warmup", "4", "--ready", "5", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["transport"] for r in report["rows"]] == transports
    for row in report["rows"]:
        assert row["plane"] == row["transport"] or row["transport"] == "auto"
        assert row["plane"] in {"tcp", "shm", "ucx"} and row["device"] == "cpu"
        lat = row["latency"]
        assert row["steps_sent"] == 40 * 16 and lat["count"] == row["steps_sent"]
        assert 0 < lat["p50_us"] <= lat["p99_us"] <= lat["max_us"]
        assert row["ready_fetch"]["count"] == 5 and row["ready_fetch"]["p50_us"] > 0


def _gpu_check(out: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    if any((ROOT / ".whl").glob("*.whl")):
        pytest.skip(".whl/ holds the GPU machine's wheels: the check would install them here")
    return subprocess.run(["bash", "ci/gpu-check.sh"], check=False, cwd=ROOT, env=_env(OUT=str(out), **env),
                          capture_output=True, text=True, timeout=80)  # fmt: skip


@no_cuda
@pytest.mark.timeout(90)
def test_gpu_check_on_a_machine_without_cuda_reports_no_cuda_and_exits_0(tmp_path):
    out = tmp_path / "gpu"
    done = _gpu_check(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no CUDA" in done.stdout
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files  # what the device tool brings back
    for name in files:
        if name.endswith(".json"):
            json.loads((out / name).read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cuda"] is False and summary["result"] == "ok" and summary["failures"] == []
    steps = {s["step"]: s for s in summary["steps"]}
    assert list(steps) == STEPS
    assert all(s["status"] in STATUSES for s in steps.values()), steps
    for name in ("gpu-tests", "gpu-throughput", "ucx-d2d", "gpu-latency", "fanout"):
        assert steps[name]["status"] == "skipped-no-cuda", steps[name]
    assert steps["env"]["status"] == "ok" and steps["env"]["file"] == "env.txt"
    assert steps["host-latency"]["status"] == "ok"  # host steps: it runs on any machine
    for name in ("ucx-d2d", "gpu-latency"):  # they ran, and said so in their JSON
        assert steps[name]["exit_status"] == 3 and json.loads((out / steps[name]["file"]).read_text())["cuda"] is False
    text = (out / "summary.txt").read_text()
    assert text.startswith("GPU check: OK") and all(f"\n{name} " in text for name in STEPS)
    assert "===== gpu-tests" in (out / "logs.txt").read_text()


@no_cuda
@pytest.mark.timeout(90)
def test_gpu_check_fails_loudly_when_a_gpu_is_seen_but_the_gpu_tests_skip(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = "-L" ] && echo "GPU 0: NVIDIA H200 (UUID: GPU-test)" || echo "a GPU"\n')
    smi.chmod(0o755)
    out = tmp_path / "gpu"
    done = _gpu_check(out, PREPEND=str(fake))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["result"] == "failed" and summary["gpus_seen_by_nvidia_smi"] == 1
    steps = {s["step"]: s for s in summary["steps"]}
    assert "GPU tests were skipped" in steps["gpu-tests"]["note"] and steps["gpu-tests"]["status"] == "failed"
    assert all(steps[n]["status"] == "failed" for n in ("env", "gpu-throughput", "ucx-d2d", "gpu-latency", "fanout"))
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("GPU check: FAILED")
    assert any(line.startswith("FAILED: gpu-tests failed: CUDA is present but") for line in lines)

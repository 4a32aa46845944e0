"""Each framework on both ends: a learner process reading batches and publishing a nested pytree
in torch, numpy, JAX or TensorFlow, and a spawned actor process over tcp that puts steps and
gets two versions in a row in the same framework. "Without torch": both processes run with torch
blocked from import (tests/integration/framework_procs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlink_ucx.wire.frameworks import importable

from .framework_procs import STEPS

ROOT = Path(__file__).resolve().parents[2]


def _skip_without(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not importable(name), reason=f"{name} not installed (pip install -e '.[{name}]')")


def run_learner(fmt: str, block: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLINK_")}
    env["FRAMEWORK_TEST_BLOCK"] = block
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.run([sys.executable, "-m", "tests.integration.framework_procs", fmt], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=270, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_tree(fmt: str, version: int) -> dict:
    tree = {
        "params": {"Dense_0": {"kernel": (np.arange(12).reshape(3, 4) + version).tolist(), "bias": [version] * 4},
                   "odd/name~": {"count": [version, 7]}},
        "step": version * 10,
    }  # fmt: skip
    if fmt != "numpy":
        tree["params"]["half"] = [0.5, version]
    return tree


def values(described: dict | list) -> dict | list:
    """The values of ``framework_procs.describe`` output, nesting kept."""
    if isinstance(described, dict):
        return {k: values(v) for k, v in described.items()}
    return described[2]


def leaves(described: dict | list) -> list:
    if isinstance(described, dict):
        return [leaf for v in described.values() for leaf in leaves(v)]
    return [described]


def check(report: dict, fmt: str, *, x64: bool) -> None:
    fields, meta = report["batch"]["fields"], report["batch"]["meta"]
    i = np.arange(STEPS)
    assert fields["obs"][:3] == [fmt, "float32", [STEPS, 3]]
    assert fields["obs"][3] == np.stack([i, -i, np.full(STEPS, 0.5)], 1).tolist()
    assert fields["action"][0] == fmt and fields["action"][3] == (i * 3).tolist()
    assert fields["action"][1] == ("int64" if x64 else "int32")  # JAX without jax_enable_x64 keeps 32 bits
    assert fields["done"][0] == fmt and fields["done"][3] == (i % 2 == 0).tolist()
    assert meta["actor_id"] == [fmt, [5] * STEPS]
    assert meta["seq"] == [fmt, i.tolist()]
    assert meta["version"] == [fmt, [0] * STEPS] and meta["staleness"] == [fmt, [0] * STEPS]
    replay = report["replay"]
    assert {kind for kind, _ in replay.values()} == {fmt}
    seq = np.array(replay["seq"][1])
    assert replay["actor_id"][1] == [6] * 16 and ((0 <= seq) & (seq < STEPS)).all()
    assert replay["obs"][1] == np.stack([seq, -seq, np.full(16, 0.5)], 1).tolist()  # each row is its own step
    assert np.array_equal(np.array(replay["index"][1]) % STEPS, seq)  # item ids: inserted in seq order
    assert all(0 < w <= 1 for w in replay["weight"][1])
    assert "publish refused" in report["last_error"] and "bad" in report["refused"]
    assert report["version"] == 2
    actor = report["actor"]
    assert "error" not in actor, actor
    assert report["actor_exit"] == 0
    assert [v for v, _ in actor["got"]] == [1, 2]
    for version, tree in actor["got"]:
        assert values(tree) == expected_tree(fmt, version)
        assert {leaf[0] for leaf in leaves(tree)} == {fmt}
    assert actor["stats"]["failures"] == 0 and actor["stats"]["rejected"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", [
    pytest.param("torch", marks=_skip_without("torch")),
    "numpy",
    pytest.param("jax", marks=_skip_without("jax")),
    pytest.param("tensorflow", marks=_skip_without("tensorflow")),
])  # fmt: skip
def test_each_framework_on_both_ends(fmt: str) -> None:
    report = run_learner(fmt)
    check(report, fmt, x64=fmt != "jax")
    assert report["actor"]["default"] == "torch"  # torch installed: get_remote_model's default stays torch
    # An actor that asks for another format never imports torch, installed or not (the
    # weights' tags are checked with numpy then).
    assert report["actor"]["torch_loaded"] == (fmt == "torch")


@pytest.mark.timeout(300)
def test_numpy_learner_and_actor_without_torch() -> None:
    report = run_learner("numpy", block="torch")
    assert report["modules_blocked"] == ["torch"]
    assert report["actor"]["blocked"] == {"torch": True}
    check(report, "numpy", x64=True)
    assert report["actor"]["default"] == "numpy"  # no torch: numpy arrays by default
    # Without torch the actor gets every version as any actor does: shared memory on this host
    # (or its weights stream), tags checked with numpy.
    stats = report["actor"]["stats"]
    assert stats["shared_reads"] + stats["streamed"] >= 2 and stats["failures"] == 0, stats


NO_TORCH_SCRIPT = """
import sys
from tests.integration import framework_procs  # installs the blocker first
import rlink_ucx
from rlink_ucx import Actor, Batch, ConfigError, Learner, RLinkDataset, ReplayDataset
assert "torch" not in sys.modules
try:
    import torch
    raise SystemExit("torch imported")
except ImportError:
    pass
with Learner("127.0.0.1:0", token=framework_procs.TOKEN) as learner:
    for make in (lambda: RLinkDataset(learner, batch_size=4, format="{fmt}"),
                 lambda: ReplayDataset(learner, capacity=8, batch_size=4, format="{fmt}")):
        try:
            make()
            raise SystemExit("no ConfigError")
        except ConfigError as exc:
            print("ConfigError:", exc)
    default = RLinkDataset(learner, batch_size=4)
    print("default:", default.format)
    with Actor(f"127.0.0.1:{{learner.port}}", token=framework_procs.TOKEN, transport="tcp") as actor:
        try:
            actor.get_remote_model(timeout=600, format="{fmt}")
            raise SystemExit("no ConfigError")
        except ConfigError as exc:
            print("ConfigError:", exc)
    default.close()
assert "torch" not in sys.modules
print("torch never imported")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["torch", "jax"])
def test_missing_framework_is_a_config_error_at_once(fmt: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLINK_")}
    env["FRAMEWORK_TEST_BLOCK"] = "torch,jax"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT.format(fmt=fmt)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    errors = [line for line in lines if line.startswith("ConfigError:")]
    assert len(errors) == 3
    assert all(f'pip install "rlink-ucx[{fmt}]"' in line for line in errors), errors
    assert "default: numpy" in lines and "torch never imported" in lines

"""The learner and actor processes of tests/integration/test_frameworks.py.

Run as ``python -m tests.integration.framework_procs FORMAT``: this process is the learner; it
spawns the actor. ``FRAMEWORK_TEST_BLOCK=torch`` (comma-separated top-level names) blocks those
modules from import in this process and in the spawned actor (the variable is inherited, and the
blocker below is installed before anything else is imported): a ``sys.meta_path`` finder raises
ImportError for them and their submodules, as in an environment where they are not installed.
Prints one JSON line with what it saw; any failed check exits non-zero.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class _Blocker:
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in self.names:
            raise ImportError(f"{name} is blocked in this test process (FRAMEWORK_TEST_BLOCK)")


BLOCKED = {n for n in os.environ.get("FRAMEWORK_TEST_BLOCK", "").split(",") if n}
if BLOCKED and not any(isinstance(f, _Blocker) for f in sys.meta_path):
    sys.meta_path.insert(0, _Blocker(BLOCKED))

import json
import multiprocessing as mp

import numpy as np

TOKEN = "framework-test-token-0123456789abcdef"
STEPS = 64


def native(fmt: str, value: np.ndarray, bfloat16: bool = False) -> Any:
    """``value`` as an array of ``fmt`` (bfloat16: cast to that framework's bfloat16)."""
    if fmt == "numpy":
        return value
    if fmt == "torch":
        import torch

        t = torch.from_numpy(value.copy())
        return t.to(torch.bfloat16) if bfloat16 else t
    if fmt == "jax":
        import jax.numpy as jnp

        return jnp.asarray(value, dtype=jnp.bfloat16 if bfloat16 else None)
    import tensorflow as tf

    t = tf.constant(value)
    return tf.cast(t, tf.bfloat16) if bfloat16 else t


def params(fmt: str, version: int) -> dict[str, Any]:
    """A flax-like nested pytree of ``fmt`` arrays whose values encode ``version``."""
    kernel = (np.arange(12, dtype=np.float32).reshape(3, 4) + version)
    tree: dict[str, Any] = {
        "params": {"Dense_0": {"kernel": native(fmt, kernel), "bias": native(fmt, np.full(4, version, np.float32))},
                   "odd/name~": {"count": native(fmt, np.array([version, 7], dtype=np.int32))}},
        "step": native(fmt, np.array(version * 10, dtype=np.int32)),
    }
    if fmt != "numpy":
        tree["params"]["half"] = native(fmt, np.array([0.5, version], dtype=np.float32), bfloat16=True)
    return tree


def framework_of(x: Any) -> str:
    root = type(x).__module__.split(".")[0]
    return {"jaxlib": "jax", "tensorflow": "tensorflow"}.get(root, root)


def dtype_name(x: Any) -> str:
    name = getattr(x.dtype, "name", None)  # numpy, JAX and TensorFlow dtypes have a name; torch's not
    return name if isinstance(name, str) else str(x.dtype).removeprefix("torch.")


def describe(tree: Any) -> Any:
    """The nesting, framework, dtype and values of a params tree (for the learner to check)."""
    if isinstance(tree, dict):
        return {k: describe(v) for k, v in tree.items()}
    value = tree.float().numpy() if framework_of(tree) == "torch" else np.asarray(tree).astype(np.float64)
    return [framework_of(tree), dtype_name(tree), np.asarray(value, dtype=np.float64).tolist()]


def put_steps(actor: Any) -> None:
    for i in range(STEPS):
        actor.put({"obs": np.array([i, -i, 0.5], np.float32), "action": np.int64(i * 3), "done": i % 2 == 0},
                  version=0)  # fmt: skip
    actor.flush(60)


def actor_main(address: str, replay_address: str, fmt: str, out: Any, go: Any) -> None:
    from rlink_ucx import Actor

    try:
        blocked = {}
        for name in BLOCKED:
            try:
                __import__(name)
                blocked[name] = False
            except ImportError:
                blocked[name] = True
        got = []
        with Actor(replay_address, token=TOKEN, transport="tcp", actor_id=6) as actor:
            put_steps(actor)
        with Actor(address, token=TOKEN, transport="tcp", actor_id=5) as actor:
            put_steps(actor)
            for _ in range(2):  # two versions in a row
                go.get(timeout=120)
                tree, version = actor.get_remote_model(timeout=60, format=fmt)
                got.append([version, describe(tree)])
                out.put(version)  # the learner publishes the next version only now
            torch_loaded = "torch" in sys.modules  # before the default format (torch, if installed)
            default_tree, _ = actor.get_remote_model(timeout=60)
            default = framework_of(default_tree["step"])
            stats = actor.stats()["weights"]
        out.put({"blocked": blocked, "got": got, "default": default, "stats": stats, "torch_loaded": torch_loaded})
    except BaseException as exc:  # the learner reports it
        out.put({"error": repr(exc)})
        raise


def learner_main(fmt: str) -> dict[str, Any]:
    from rlink_ucx import Learner, ReplayDataset, RLinkDataset

    report: dict[str, Any] = {"modules_blocked": sorted(BLOCKED)}
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Queue()
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner, \
            Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as replay_learner:
        dataset = RLinkDataset(learner, batch_size=STEPS, format=fmt)
        replay = ReplayDataset(replay_learner, capacity=STEPS, batch_size=16, sampler="prioritized", format=fmt,
                               min_size=STEPS, seed=1)  # fmt: skip
        proc = ctx.Process(target=actor_main, args=(f"127.0.0.1:{learner.port}", f"127.0.0.1:{replay_learner.port}",
                                                   fmt, out, go))  # fmt: skip
        proc.start()
        try:
            sample = replay.sample(timeout=120)
            report["replay"] = {k: [framework_of(getattr(sample, k)), np.asarray(getattr(sample, k)).tolist()]
                                for k in ("index", "weight", "seq", "actor_id")}  # fmt: skip
            report["replay"]["obs"] = [framework_of(sample["obs"]), np.asarray(sample["obs"]).tolist()]
            replay.update_priorities(sample.index, np.ones(16, np.float32))
            replay.close()
            batch = dataset.fetch(timeout=120)
            fields = {k: [framework_of(v), dtype_name(v), list(v.shape), np.asarray(v).tolist()] for k, v in batch.items()}
            meta = {k: [framework_of(getattr(batch, k)), np.asarray(getattr(batch, k)).tolist()]
                    for k in ("version", "actor_id", "seq", "staleness")}  # fmt: skip
            report["batch"] = {"fields": fields, "meta": meta}
            learner.publish(params(fmt, 1), wait=True, timeout=60)
            go.put(1)
            report["acks"] = [out.get(timeout=180)]
            try:  # a publish that raises changes nothing
                learner.publish({"params": {"bad": object()}})
            except TypeError as exc:
                report["refused"] = str(exc)
            report["last_error"] = learner.stats()["weights"]["last_error"]
            learner.publish(params(fmt, 2), wait=True, timeout=60)
            report["version"] = learner.version
            go.put(2)
            report["acks"].append(out.get(timeout=180))
            report["actor"] = out.get(timeout=180)
            proc.join(60)
            report["actor_exit"] = proc.exitcode
        finally:
            if proc.is_alive():
                proc.kill()
        dataset.close()
    return report


if __name__ == "__main__":
    print(json.dumps(learner_main(sys.argv[1])), flush=True)

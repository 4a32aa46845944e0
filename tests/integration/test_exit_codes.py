"""A script that closed its objects exits 0: under torchrun or SLURM any other code fails the job.

Each public object's lifecycle runs in a fresh interpreter, several times, because what goes
wrong at exit (a thread still inside torch when the interpreter finalises: SIGABRT, exit code
134) happens in some runs only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_ACTOR = """
import threading

# Process-wide helpers, shared by every learner and actor of the process, that hold no torch
# state while idle: the weights tagger (a ThreadPoolExecutor, joined at interpreter exit) and
# the replay's gather helper (blocked on its queue).
SHARED = ("rlink-tags", "rlink-replay-gather")


def leftover():
    return sorted(t.name for t in threading.enumerate()
                  if t is not threading.main_thread() and t.is_alive() and not t.name.startswith(SHARED))


def actor(address, n, big):
    import numpy as np
    from rlink_ucx import Actor
    with Actor(address, transport="tcp") as a:
        for _ in range(n):
            a.put_many({"obs": np.ones((100, 84, 84) if big else (100, 4), np.uint8), "r": np.zeros(100, np.float32)})
        a.flush(30)
"""

SCRIPTS = {
    # The replay's default uniform sampler draws batches ahead on threads of its own.
    "replay": _ACTOR + """
if __name__ == "__main__":
    import multiprocessing as mp
    from rlink_ucx import Learner, ReplayDataset
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        replay = ReplayDataset(learner, capacity=2000, batch_size=64)
        p = mp.get_context("spawn").Process(target=actor, args=(learner.address, 30, True))
        p.start()
        for _ in range(50):
            replay.sample(timeout=30)
        p.join(60)
    assert leftover() == [], leftover()  # closing the learner stopped and joined its replay's threads
    print("exited", p.exitcode)
""",
    "dataset": _ACTOR + """
if __name__ == "__main__":
    import multiprocessing as mp
    from rlink_ucx import Learner, RLinkDataset
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=100)
        p = mp.get_context("spawn").Process(target=actor, args=(learner.address, 10, False))
        p.start()
        for _ in range(10):
            dataset.fetch(timeout=30)
        p.join(60)
    assert leftover() == [], leftover()
    print("exited", p.exitcode)
""",
    "weights": _ACTOR + """
if __name__ == "__main__":
    import torch
    from rlink_ucx import Actor, Learner
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        with Actor(learner.address, transport="tcp") as actor:
            for v in range(1, 4):
                learner.publish({"w": torch.full((64,), float(v))}, wait=True, timeout=30)
                state, version = actor.get_remote_model(timeout=30)
            assert version == 3 and float(state["w"][0]) == 3.0
    assert leftover() == [], leftover()
    print("exited", 0)
""",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,runs", [("replay", 5), ("dataset", 2), ("weights", 2)])
def test_a_script_that_closed_its_objects_exits_0_every_time(name, runs, tmp_path):
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPTS[name])
    codes = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        codes.append(proc.returncode)
        assert proc.returncode == 0, f"run {len(codes)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
        assert "exited 0" in proc.stdout
    assert codes == [0] * runs

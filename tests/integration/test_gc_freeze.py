"""``Config.gc_freeze``: at a learner's first batch every object alive is frozen out of the
garbage collector's way (``gc.freeze``), once per process; ``RLINK_GC_FREEZE=0`` keeps it off.
Each case runs in a fresh interpreter (the freeze is once per process), with a real learner and
a real actor over tcp on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CHILD = r"""
import gc, json, threading
import numpy as np
freezes = []
_freeze = gc.freeze
gc.freeze = lambda: (freezes.append(1), _freeze())
from rlink_ucx import Actor, Learner, RLinkDataset

with Learner("127.0.0.1:0", transport="tcp") as learner:
    before = gc.get_freeze_count()
    def act():
        with Actor(learner.address, transport="tcp") as actor:
            for i in range(64):
                actor.put({"x": np.full(3, i, np.float32)})
            actor.flush(30)
    t = threading.Thread(target=act)
    t.start()
    dataset = RLinkDataset(learner, batch_size=16, format="numpy")
    first = dataset.fetch(timeout=30)
    after_first = gc.get_freeze_count()
    dataset.fetch(timeout=30)
    after_second = gc.get_freeze_count()
    t.join(30)
print(json.dumps({"before": before, "after_first": after_first, "after_second": after_second, "calls": len(freezes),
                  "first_x": first["x"][:, 0].tolist()}))
"""


def _run(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RLINK_GC_FREEZE"}  # the suite turns it off
    env.update(env_extra)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=100,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_first_batch_freezes_what_is_alive_then_and_nothing_after():
    out = _run({})
    assert out["before"] == 0
    assert out["after_first"] > 10_000  # numpy and rlink's own modules, at least
    assert out["calls"] == 1  # once per process
    assert out["first_x"] == list(range(16))  # the batch itself is unchanged


def test_rlink_gc_freeze_0_leaves_the_collector_alone():
    out = _run({"RLINK_GC_FREEZE": "0"})
    assert out["before"] == out["after_first"] == out["after_second"] == 0 and out["calls"] == 0
    assert out["first_x"] == list(range(16))

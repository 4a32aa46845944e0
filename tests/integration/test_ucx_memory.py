"""The ucx plane keeps steps out of memory other users can map: no sysv segments (UCX makes
them group read/write, mode 660, and lists them in /proc/sysvipc/shm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ucx_importable

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys
import numpy as np
from rlink_ucx import Actor, Learner, RLinkDataset

def segments():
    rows = [r.split() for r in open("/proc/sysvipc/shm").read().splitlines()[1:]]
    return [r for r in rows if str(os.getpid()) in (r[4], r[5])]  # created or last attached by us

with Learner("127.0.0.1:0", transport="ucx") as learner:
    dataset = RLinkDataset(learner, batch_size=64)
    with Actor(learner.address, transport="ucx") as actor:
        assert actor.transport == "ucx", actor.transport
        for i in range(4):  # a small field (in the header message) and a large one (rendezvous)
            actor.put_many({"small": np.full((16, 4), i, np.float32), "big": np.full((16, 30000), i, np.float32)})
        actor.flush(30)
        got = [dataset.fetch(timeout=30) for _ in range(1)]
        assert sorted(got[0].seq.tolist()) == list(range(64))
        print("segments", len(segments()), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")
@pytest.mark.parametrize("tls,expect_none", [(None, True), ("sysv,tcp,cma", False)])
def test_the_ucx_plane_makes_no_sysv_segments_unless_the_user_asks_for_them(tls, expect_none):
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    if tls:
        env["UCX_TLS"] = tls  # the user's choice wins: then sysv is used, which shows the check can see it
    proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=100,
                          cwd=ROOT, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    count = int(proc.stdout.split("segments")[1])
    assert (count == 0) if expect_none else (count > 0), proc.stdout

"""The deployment entry scripts across two "hosts" (network namespaces joined by a veth pair):
the learner started as torchrun's rank 0 through examples/deploy/launch.py in one namespace,
one actor as rank 1 through the same script and one through examples/deploy/actor.py (as the
compose file and the Kubernetes Job start it) in the other. Needs root and iproute2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.integration.test_netns import ROOT, exits_cleanly, killed_at_exit, two_hosts  # noqa: F401 - a fixture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root and iproute2")
STEPS = 5000


def start_in(ns: str, script: str, args: list[str], **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RLINK_", "RANK", "WORLD_SIZE", "MASTER_"))}
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.join(ROOT, "examples/deploy", script),
                             *args], cwd=ROOT, env={**clean, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.mark.timeout(180)
def test_recipe_entry_scripts_stream_between_two_hosts(two_hosts, tmp_path):  # noqa: F811 - the fixture
    ns_learner, ns_actor, _ = two_hosts
    summary = tmp_path / "summary.json"
    common = {"RLINK_TOKEN": "deploy-" + uuid.uuid4().hex, "RLINK_TRANSPORT": "tcp", "RLINK_PORT": "7446"}
    rank = {"WORLD_SIZE": "3", "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500"}  # as torchrun sets them
    learner = start_in(ns_learner, "launch.py", ["--steps", str(STEPS), "--summary", str(summary)], RANK="0",
                       **rank, **common)  # fmt: skip
    ranked = start_in(ns_actor, "launch.py", ["--steps", str(STEPS)], RANK="1", **rank, **common)
    plain = start_in(ns_actor, "actor.py", ["--steps", str(STEPS)], RLINK_ADDRESS="10.77.0.1:7446",
                     RLINK_ACTOR_ID="2", **common)  # fmt: skip
    with killed_at_exit(ranked, plain, learner):
        for proc in (ranked, plain, learner):
            exits_cleanly(proc, 120)
    got = json.loads(summary.read_text())
    assert got["complete"] and got["in_order"] and got["per_actor"] == {"1": STEPS, "2": STEPS}, got
    assert got["transports"] == ["tcp"] and got["address"] == "0.0.0.0:7446"

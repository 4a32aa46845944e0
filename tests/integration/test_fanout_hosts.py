"""Weights to actors on many hosts (network namespaces with their own host names, shaped links):
every actor gets every version bit-exact, and the learner's link carries one copy per host.

The bench behind ``rlink bench --suite fanout`` runs it (``rlink_ucx/bench/fanout_hosts.py``);
the byte counts are the learner's own link's counters. Needs root; skipped elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlink_ucx.bench.fanout_hosts import run
from rlink_ucx.bench.netns import available

WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")


def check_delivered(mode: dict, actors: int, versions: int) -> None:
    assert mode["all_confirmed"] and mode["every_version_exact"], mode["actors"]
    assert len(mode["actors"]) == actors
    for actor in mode["actors"]:  # every version after the first, each bit-exact
        assert actor["exact"] and actor["versions"][-1] == versions + 1, actor


@pytest.mark.timeout(420)
def test_eight_hosts_of_four_actors_take_one_copy_per_host():
    report = run(8, 4, mb=1, mbit=400, versions=2, modes=("per-host",))
    mode = report["modes"]["per-host"]
    check_delivered(mode, 32, 2)
    # one copy per host (8), not one per actor (32); headers and TCP/IP overhead within 4%
    assert 8.0 <= mode["x_model_bytes"] <= 8.32, mode["x_model_bytes"]
    streamed = sorted(a["weights"]["streamed"] for a in mode["actors"])
    assert streamed.count(3) == 8 and streamed.count(1) == 24, streamed  # 8 streamers; peers streamed only v1
    assert sum(a["weights"]["shared_reads"] for a in mode["actors"]) == 24 * 2


@pytest.mark.timeout(300)
def test_the_cli_compares_a_star_with_one_copy_per_host(tmp_path):
    out = tmp_path / "fanout.json"
    done = subprocess.run([sys.executable, "-m", "rlink_ucx", "bench", "--suite", "fanout", "--hosts", "2",
                           "--actors-per-host", "3", "--mb", "1", "--mbit", "200", "--versions", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=280, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "star" in done.stdout and "per-host" in done.stdout
    report = json.loads(out.read_text())
    star, per_host = report["modes"]["star"], report["modes"]["per-host"]
    check_delivered(star, 6, 2)
    check_delivered(per_host, 6, 2)
    assert 6.0 <= star["x_model_bytes"] <= 6.24 and 2.0 <= per_host["x_model_bytes"] <= 2.08, report["modes"]
    assert report["raw_transfer_seconds"] > 0

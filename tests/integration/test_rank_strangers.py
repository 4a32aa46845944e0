"""Learner ranks another user cannot crash (issue 48, finding 1): two ranks under torchrun, each
with an open-file limit of 1024, and another uid without any token opening and closing 3,000
connections to every TCP port either rank process listens on. rlink makes no torch.distributed
group (whose gloo listener kept every accepted socket and aborted the process at the limit):
the ranks listen on rlink's own ports only, both live, their open files stay flat, and an actor
started afterwards delivers. With the job's own gloo group (made by the script), rlink adds no
listener beside it: only the learner's own port. The churn runs as uid 65534 through setpriv
(bench/hostile_load.py); the ranks are tests/integration/ranks_job.py."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_many_learners import (
    ROOT,
    actors,
    check_exactly_once,
    finish,
    logs,
    results,
    torchrun,
    wait_files,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as another user")  # fmt: skip

PER_PORT = 3000


@pytest.fixture
def hostile_load(monkeypatch: pytest.MonkeyPatch) -> Any:
    """bench/hostile_load.py (its /proc readers and its churn as another uid)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("hostile_load")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("gloo", [False, True], ids=["no-group", "job-s-own-gloo-group"])
def test_a_stranger_churning_every_port_of_two_ranks_harms_neither(tmp_path: Path, hostile_load: Any, gloo: bool):
    job = torchrun(2, tmp_path, "--versions", "0", "--nofile", "1024", "--seconds", "300",
                   *(["--gloo"] if gloo else ["--no-torch"]))  # fmt: skip
    acts: list[subprocess.Popen] = []
    try:
        wait_files(tmp_path, ["address", "rank0.started.json", "rank1.started.json"], 120, [job])
        started = [json.loads((tmp_path / f"rank{r}.started.json").read_text()) for r in range(2)]
        for rank in started:  # what the learner added to the process's listeners: its own port only
            added = {tuple(s) for s in rank["after"]} - {tuple(s) for s in rank["before"]}
            assert added == {("127.0.0.1", rank["port"])}, (rank, gloo)
            if not gloo:  # and without the job's own group the process listens on nothing else
                assert {tuple(s) for s in rank["after"]} == added, rank
        pids = [rank["pid"] for rank in started]
        # Every TCP port either rank process listens on (the job's own gloo listeners included:
        # they are the user's, so only rlink's are churned where the job made a group).
        ports = sorted({p for pid, rank in zip(pids, started, strict=True) for p in hostile_load.listening_ports(pid)
                        if not gloo or p == rank["port"]})  # fmt: skip
        assert len(ports) == 2, ports
        files = [hostile_load.open_files(pid) for pid in pids]
        churn = hostile_load.churn(ports, seconds=300, rate=1000, limit=PER_PORT * len(ports))
        report = json.loads(churn.communicate(timeout=330)[0])
        assert job.poll() is None, logs(tmp_path)  # both ranks (and so the job) live
        assert report["connections"] + report["failed"] == PER_PORT * len(ports), report
        assert min(report["per_port"].values()) >= PER_PORT * 0.9, report  # most were accepted
        grown = [hostile_load.open_files(pid) - before for pid, before in zip(pids, files, strict=True)]
        print(json.dumps({"gloo": gloo, "ports": ports, "churn": report, "open_files": files, "grown": grown}))
        assert max(grown) < 200, (files, grown)
        acts = actors(tmp_path, 2, 200)  # new actors, placed one on each rank, deliver
        finish(acts, 120)
        finish([job], 90)
    except BaseException:
        print(logs(tmp_path))
        raise
    finally:
        for p in [job, *acts]:
            p.kill()
    home = check_exactly_once(tmp_path, 2, 2, 200)
    assert sorted(home.values()) == [0, 1], home
    for got in results(tmp_path, 2):
        assert got["error"] is None, got
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["torch_loaded"] for s in summaries] == [gloo, gloo]  # without a group of its own, ranks run without torch

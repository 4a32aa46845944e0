"""`rlink stats ADDR` and `rlink doctor --learner ADDR` against running learners: a lone
`rlink learner` process, and a job of two learner ranks (tests/integration/ranks_job.py) with
actor processes (ranks_actor.py) that know only rank 0's address. The CLI runs as a child
process, as a user runs it; every learner and actor is a real process over loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlink_ucx.session.tokens import new_token, write_new
from tests.integration.test_many_learners import ACTOR, ROOT, actors, clean_env, logs, ranks_by_hand, wait_files


def rlink(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlink_ucx", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env or clean_env())  # fmt: skip


def stats_json(*args: str, env: dict[str, str] | None = None) -> dict:
    proc = rlink("stats", "--json", *args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


SIGINT_AS_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); os.execv(sys.argv[1], sys.argv[1:])")


def signal_state(pid: int) -> str:
    """What a process that did not exit was doing: its signal masks, state and wait channel."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = [line.strip() for line in f if line.startswith(("State", "SigBlk", "SigIgn", "SigCgt", "Threads"))]
        with open(f"/proc/{pid}/wchan") as f:
            lines.append("wchan " + f.read())
    except OSError as exc:
        return f"(no /proc entry: {exc})"
    finally:
        os.kill(pid, signal.SIGKILL)
    return "; ".join(lines)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def lone_learner(tmp_path: Path, token_file: Path) -> tuple[subprocess.Popen, str]:
    learner = subprocess.Popen([sys.executable, "-m", "rlink_ucx", "learner", "--address", "127.0.0.1:0",
                                "--token-file", str(token_file), "--batch-size", "16"], cwd=ROOT, env=clean_env(),
                               stdout=subprocess.PIPE, stderr=open(tmp_path / "learner.log", "w"), text=True)  # fmt: skip
    assert learner.stdout is not None
    line = learner.stdout.readline()  # "listening on HOST:PORT", printed once bound
    assert line.startswith("listening on "), (line, (tmp_path / "learner.log").read_text()[-2000:])
    return learner, line.split()[-1]


def lone_actors(tmp_path: Path, address: str, token_file: Path, count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, str(ACTOR), "--out", str(tmp_path), "--index", str(i), "--address",
                              address, "--steps", "20000", "--pace", "0.002"], cwd=ROOT,
                             env=clean_env(RLINK_TOKEN_FILE=str(token_file)), stdout=open(tmp_path / f"actor{i}.log", "w"),
                             stderr=subprocess.STDOUT)  # fmt: skip
            for i in range(count)]


@pytest.mark.timeout(180)
def test_stats_of_a_lone_learner_with_its_token_file_as_json_text_and_watch(tmp_path):
    token_file = tmp_path / "token"
    write_new(str(token_file), new_token())
    learner, address = lone_learner(tmp_path, token_file)
    acts: list[subprocess.Popen] = []
    try:
        acts = lone_actors(tmp_path, address, token_file, 2)
        wait_files(tmp_path, ["actor0.connected", "actor1.connected"], 90, [learner, *acts])
        got = stats_json(address, "--token-file", str(token_file), "--interval", "1")
        [row] = got["ranks"]
        assert row["rank"] == 0 and row["address"] == address and row["actors"] == 2 and row["error"] == ""
        assert row["steps_per_s"] > 0 and row["mb_per_s"] > 0 and row["steps"] > 0, row
        [full] = got["stats"]  # exactly what learner.stats() returns there
        assert full["world_size"] == 1 and full["connected_actors"] == 2 and full["address"] == address
        assert len(full["actors"]) == 2 and all(a["steps"] > 0 for a in full["actors"]), full["actors"]
        assert {"buffer", "total", "weights", "staleness"} <= set(full)
        assert full["total"]["steps"] >= row["steps"] > 0 and 0.9 <= got["interval_s"] < 10

        text = rlink("stats", address, "--token-file", str(token_file), "--interval", "0.5")
        assert text.returncode == 0, text.stderr
        assert "learner job of 1 rank;" in text.stdout and f"   0  {address}" in text.stdout, text.stdout
        assert "total: 2 actors," in text.stdout, text.stdout

        wrong = tmp_path / "wrong"
        write_new(str(wrong), new_token())
        refused = rlink("stats", address, "--token-file", str(wrong))
        assert refused.returncode == 1 and "refused the token" in refused.stderr and refused.stdout == "", refused
        none = rlink("stats", address)  # no token anywhere: said so, not a hang
        assert none.returncode == 1 and "requires a token" in none.stderr, none

        doctor = rlink("doctor", "--json", "--learner", address, "--attempts", "1", "--token-file", str(token_file),
                       timeout=120)  # fmt: skip
        checks = json.loads(doctor.stdout)["checks"]
        assert checks["learner"]["status"] in ("ok", "warn") and checks["learner"]["auth"] == "ok", checks["learner"]
        assert checks["token"]["source"] == "RLINK_TOKEN_FILE", checks["token"]  # the row sees the same file
        assert checks["learner_job"]["world_size"] == 1 and "a lone learner" in checks["learner_job"]["summary"]
        refused = json.loads(rlink("doctor", "--json", "--learner", address, "--attempts", "1", "--token-file",
                                   str(wrong), timeout=120).stdout)["checks"]  # fmt: skip
        assert refused["learner"]["auth"] == "failed" and "learner_job" not in refused, refused["learner"]

        # Ctrl-C as a terminal delivers it: SIGINT neither ignored nor blocked, whatever this test
        # process inherited or was left with (both pass through exec to the child).
        argv = [sys.executable, "-m", "rlink_ucx", "stats", address, "--json", "--watch", "0.5", "--token-file",
                str(token_file)]  # fmt: skip
        watching = subprocess.Popen([sys.executable, "-c", SIGINT_AS_A_TERMINAL, *argv], cwd=ROOT, env=clean_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert watching.stdout is not None
        rounds = [json.loads(watching.stdout.readline()) for _ in range(3)]
        watching.send_signal(signal.SIGINT)
        try:
            _, err = watching.communicate(timeout=60)  # read on: a child blocked on a full pipe cannot exit
        except subprocess.TimeoutExpired:
            pytest.fail(f"rlink stats --watch did not exit after SIGINT: {signal_state(watching.pid)}")
        assert watching.returncode == 130 and "Traceback" not in err, err[-2000:]
        steps = [r["ranks"][0]["steps"] for r in rounds]
        assert steps == sorted(steps) and steps[-1] > steps[0], steps  # refreshed: the counters moved on
        assert all(0.4 <= r["interval_s"] < 5 for r in rounds), rounds
    finally:
        stop([*acts, learner])


@pytest.mark.timeout(300)
def test_stats_and_doctor_of_a_two_rank_job_show_ranks_placement_and_rates(tmp_path):
    job = ranks_by_hand(2, tmp_path, "--versions", "0", "--seconds", "120")
    acts: list[subprocess.Popen] = []
    try:
        wait_files(tmp_path, ["address"], 90, job)
        address = (tmp_path / "address").read_text().strip()
        acts = actors(tmp_path, 4, steps=20000, pace=0.003)
        wait_files(tmp_path, [f"actor{i}.connected" for i in range(4)], 120, [*job, *acts])
        # No token given: rank 0's generated one, found by its port, serves for every rank.
        got = stats_json(address, "--interval", "1")
        ranks = got["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["error"] == "" for r in ranks), ranks
        assert ranks[0]["address"] == address and ranks[1]["address"] != address
        assert sum(r["actors"] for r in ranks) == 4 and all(r["actors"] >= 1 for r in ranks), ranks
        assert all(r["steps_per_s"] > 0 for r in ranks), ranks
        listed = {int(k): v for k, v in got["stats"][0]["ranks"].items()}  # rank 0's table of the job
        assert listed[1]["address"] == ranks[1]["address"] and got["stats"][1]["rank"] == 1
        assert {s["world_size"] for s in got["stats"]} == {2}

        text = rlink("stats", address, "--interval", "0.5")
        assert text.returncode == 0 and "learner job of 2 ranks;" in text.stdout, (text.stdout, text.stderr)
        assert f"   1  {ranks[1]['address']}" in text.stdout and "total: 4 actors," in text.stdout, text.stdout

        doctor = rlink("doctor", "--json", "--learner", address, "--attempts", "1", timeout=120)
        report = json.loads(doctor.stdout)
        row = report["checks"]["learner_job"]
        assert row["status"] == "ok" and row["world_size"] == 2, row
        assert [r["rank"] for r in row["ranks"]] == [0, 1] and sum(r["actors"] for r in row["ranks"]) >= 4, row
        assert "a job of 2 learner ranks" in row["summary"] and ranks[1]["address"] in row["summary"], row
    except AssertionError:
        print(logs(tmp_path))
        raise
    finally:
        stop([*acts, *job])


@pytest.mark.timeout(60)
def test_stats_of_no_learner_fails_fast_and_says_so(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc = rlink("stats", f"127.0.0.1:{port}", "--timeout", "3", env={**clean_env(), "RLINK_TOKEN": new_token()})
    assert proc.returncode == 1 and f"127.0.0.1:{port}" in proc.stderr and time.monotonic() - t0 < 30, proc
    bad = rlink("stats", "127.0.0.1:notaport")
    assert bad.returncode == 2 and "port" in bad.stderr, bad

"""`rlink doctor`: the checks read this machine's real values, and a real learner is reached
(or refused) through a real handshake. The doctor runs as a child process, as a user runs it."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import resource
import socket
import subprocess
import sys
import uuid

import pytest

from rlink_ucx import Learner
from rlink_ucx.config import Config
from rlink_ucx.doctor import checks as doctor, remote as doctor_learner
from rlink_ucx.session.learner.admission import FDS_PER_ACTOR, FDS_SPARE, listen_backlog

NAMES = {"ucxx", "ucx_transports", "rdma", "cuda", "nccl", "shm", "nofile", "somaxconn", "token"}


def run_doctor(*args: str, env: dict[str, str] | None = None, nofile: tuple[int, int] | None = None,
               timeout: float = 90) -> tuple[int, dict]:  # fmt: skip
    def limit() -> None:  # in the child only: the test process keeps its own limit
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    proc = subprocess.run([sys.executable, "-m", "rlink_ucx", "doctor", "--json", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          preexec_fn=limit if nofile else None)  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-3000:]}") from None


@pytest.mark.timeout(120)
def test_json_reports_the_real_values_of_this_machine():
    rc, report = run_doctor("--actors", "8")
    checks = report["checks"]
    assert set(checks) == NAMES and report["rlink_ucx"] == __import__("rlink_ucx").__version__
    assert all(c["status"] in doctor.STATUSES and c["summary"] for c in checks.values())
    assert report["status"] == doctor.worst([doctor.Check(n, c["status"], "") for n, c in checks.items()])
    assert rc == (1 if report["status"] == "fail" else 0)
    installed = importlib.util.find_spec("ucxx") is not None
    assert checks["ucxx"]["importable"] is installed
    if installed:  # this project's venv has it: UCX sees at least TCP
        assert checks["ucxx"]["status"] == "ok" and checks["ucxx"]["ucx_version"] and checks["ucxx"]["starts"] is True
        assert checks["ucx_transports"]["tcp"] is True and "lo" in checks["ucx_transports"]["transports"]["tcp"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    config = Config()
    assert (checks["nofile"]["soft"], checks["nofile"]["hard"]) == (soft, hard)
    assert checks["nofile"]["need"] == FDS_PER_ACTOR * config.max_connections + FDS_SPARE
    with open("/proc/sys/net/core/somaxconn") as fh:
        assert checks["somaxconn"]["somaxconn"] == int(fh.read())
    assert checks["somaxconn"]["backlog"] == listen_backlog(config)
    st = os.statvfs("/dev/shm")
    assert checks["shm"]["size_bytes"] == st.f_blocks * st.f_frsize
    assert checks["shm"]["need_bytes"] == 8 * config.shm_ring_bytes and checks["shm"]["actors"] == 8
    assert checks["rdma"]["devices"] == {} or os.path.isdir("/sys/class/infiniband")
    torch = pytest.importorskip("torch")
    assert checks["cuda"]["torch"] == torch.__version__ and checks["cuda"]["available"] == torch.cuda.is_available()
    assert checks["nccl"]["gloo"] == torch.distributed.is_gloo_available()
    assert checks["token"]["source"] is None and checks["token"]["rlink_token_set"] is False


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")
def test_a_ucx_variable_that_ucx_rejects_fails_the_ucxx_row_and_names_it():
    rc, report = run_doctor(env={"UCX_RNDV_THRESH": "intra:1m"})  # UCX wants "inter" too
    row = report["checks"]["ucxx"]
    assert row["status"] == "fail" and row["starts"] is False
    assert "UCX did not start" in row["summary"] and "UCX_RNDV_THRESH=intra:1m" in row["summary"]
    assert rc == 1 and report["status"] == "fail"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("token", ["given", "generated"])
def test_a_running_learner_is_reached_with_a_positive_connect_time(token):
    secret = "doctor-" + uuid.uuid4().hex if token == "given" else None
    with Learner("127.0.0.1:0", token=secret) as learner:
        # "generated": the learner writes its own token and the doctor, as this user's local
        # actor, finds it; "given": the doctor gets it from RLINK_TOKEN.
        rc, report = run_doctor("--learner", learner.address, "--attempts", "2",
                                env={"RLINK_TOKEN": secret} if secret else None)  # fmt: skip
        ended = learner.stats()["ended_actors"]
    row = report["checks"]["learner"]
    assert row["status"] in ("ok", "warn"), row
    assert row["reachable"] is True and row["auth"] == "ok" and row["address"] == learner.address
    assert row["rtt_ms"] > 0 and len(row["connect_ms"]) == 2 and all(t > 0 for t in row["connect_ms"])
    assert row["transport"] in ("shm", "tcp", "ucx") and row["transport_reason"]
    assert len(ended) == 2, ended  # two real sessions came and went
    assert report["checks"]["token"]["source"] == ("RLINK_TOKEN" if secret else None)
    assert rc == (1 if report["status"] == "fail" else 0)


@pytest.mark.timeout(120)
def test_a_wrong_token_is_a_failed_auth_row_and_a_failing_exit_code():
    with Learner("127.0.0.1:0", token="right-" + uuid.uuid4().hex) as learner:
        rc, report = run_doctor("--learner", learner.address, env={"RLINK_TOKEN": "wrong-" + uuid.uuid4().hex})
        assert learner.stats()["ended_actors"] == []  # refused before it became a session
    row = report["checks"]["learner"]
    assert row["status"] == "fail" and row["reachable"] is True and row["auth"] == "failed", row
    assert "token" in row["advice"] and "authentication failed" in row["summary"]
    assert rc == 1 and report["status"] == "fail"


@pytest.mark.timeout(120)
def test_nobody_listening_is_an_unreachable_learner():
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc, report = run_doctor("--learner", f"127.0.0.1:{port}", "--timeout", "1", "--attempts", "1")
    row = report["checks"]["learner"]
    assert row["status"] == "fail" and row["reachable"] is False and row["auth"] == "not tried", row
    assert rc == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit,status", [(64, "fail"), (1024, "warn")])
def test_a_low_open_file_limit_is_flagged(limit, status):
    # 64 files hold no actor at all (the learner keeps 256 spare); 1024 hold 192 of the
    # default max_connections=1024.
    rc, report = run_doctor("--actors", "4", nofile=(limit, limit))
    row = report["checks"]["nofile"]
    assert (row["soft"], row["hard"]) == (limit, limit)
    assert row["status"] == status and row["actor_capacity"] == max(0, (limit - FDS_SPARE) // FDS_PER_ACTOR), row
    assert f"ulimit -n {row['need']}" in row["advice"]
    assert (rc == 1) == (report["status"] == "fail") and (status != "fail" or rc == 1)


def test_text_report_has_one_row_per_check_and_the_verdict():
    checks = [doctor.Check("alpha", "ok", "fine"), doctor.Check("beta", "warn", "low", "raise it"),
              doctor.Check("gamma", "skip", "n/a")]  # fmt: skip
    for render in (doctor_learner.render, lambda c, out: doctor_learner._plain(c, out)):
        out = io.StringIO()
        render(checks, out)
        text = out.getvalue()
        assert all(name in text for name in ("alpha", "beta", "gamma", "raise it")), text
        assert "overall: warn" in text
    out = io.StringIO()
    doctor_learner.render(checks, out, as_json=True)
    assert json.loads(out.getvalue())["checks"]["beta"] == {"status": "warn", "summary": "low", "advice": "raise it"}

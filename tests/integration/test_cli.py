"""The `rlink` command: info reports the environment; smoke streams and verifies real steps."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlink_ucx import cli


@pytest.mark.timeout(60)
def test_info_json_reports_versions_and_auto_choice(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rlink_ucx"] == __import__("rlink_ucx").__version__
    assert report["auto_data_plane"] in ("tcp", "ucx") and report["auto_reason"]
    assert report["auto_same_host_data_plane"] == "shm" and "same host" in report["auto_same_host_reason"]
    if report["ucxx_installed"]:
        assert report["ucx_version"] and "tcp" in report["ucx_transports"]


@pytest.mark.timeout(120)
def test_smoke_streams_every_step_exactly_once(capsys):
    assert cli.main(["smoke", "--actors", "2", "--steps", "3000", "--transport", "tcp"]) == 0
    out = capsys.readouterr().out
    assert "received 6000 steps from 2 actors" in out and "exactly once: True" in out


@pytest.mark.timeout(60)
def test_rlink_learner_closes_on_sigterm_and_removes_its_generated_token_file(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RLINK_TOKEN_DIR": str(tmp_path / "tokens")}
    env.pop("RLINK_TOKEN", None)
    env.pop("RLINK_TOKEN_FILE", None)
    proc = subprocess.Popen([sys.executable, "-m", "rlink_ucx", "learner", "--address", "127.0.0.1:0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("token for this user's local actors: "):
                break
        token_file = Path(lines[-1].split(": ", 1)[1].strip())
        assert token_file.exists() and token_file.parent == tmp_path / "tokens", lines
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not token_file.exists()
    assert "Traceback" not in err, err

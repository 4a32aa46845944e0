"""The `rlink` command: info reports the environment; smoke streams and verifies real steps."""

import json

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

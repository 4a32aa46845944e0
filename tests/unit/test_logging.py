"""The one documented switch that shows rlink's logs: RLINK_LOG or log_to_stderr()."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import rlink_ucx

CHILD = "import logging, rlink_ucx; logging.getLogger('rlink_ucx.session').info('seen'); " \
        "logging.getLogger('rlink_ucx.session').debug('detail')"


def run_child(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RLINK_LOG"}
    if env_value is not None:
        env["RLINK_LOG"] = env_value
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.timeout(120)
def test_rlink_log_shows_records_at_its_level_and_nothing_without_it():
    quiet, info, debug = run_child(None), run_child("INFO"), run_child("debug")
    assert quiet.returncode == info.returncode == debug.returncode == 0
    assert quiet.stderr == ""
    assert "INFO rlink_ucx.session: seen" in info.stderr and "detail" not in info.stderr
    assert "seen" in debug.stderr and "DEBUG rlink_ucx.session: detail" in debug.stderr


@pytest.mark.timeout(120)
def test_a_bad_rlink_log_value_warns_and_the_package_still_imports():
    bad = run_child("LOUD")
    assert bad.returncode == 0 and "RLINK_LOG ignored" in bad.stderr and "seen" not in bad.stderr


def test_log_to_stderr_installs_one_handler_and_can_be_undone(capsys):
    logger = logging.getLogger("rlink_ucx")
    before, level = list(logger.handlers), logger.level
    try:
        rlink_ucx.log_to_stderr("WARNING")
        handler = rlink_ucx.log_to_stderr("INFO")  # a second call replaces the first
        assert len(logger.handlers) == len(before) + 1 and logger.level == logging.INFO
        with pytest.raises(rlink_ucx.ConfigError, match="log level"):
            rlink_ucx.log_to_stderr("LOUD")
        logger.removeHandler(handler)
        assert logger.handlers == before
    finally:
        logger.setLevel(level)

"""`rlink demo --quick` and examples/learner.py say at once that they started, then print a
progress line at least every 10 s, with or without batches coming in."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.test_reliability import free_port

ROOT = Path(__file__).resolve().parents[2]


def timed_lines(args: list[str], seconds: float, tmp_path: Path) -> tuple[list[tuple[float, str]], int | None]:
    """Run ``args`` (stdout read line by line as it comes) for at most ``seconds``: every line
    with the seconds since the process started, and the exit code (None: it was still running)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RLINK_TOKEN_DIR": str(tmp_path / "tokens")}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        proc.kill()
        proc.wait(30)
        reader.join(30)
    return lines, code


def gaps(lines: list[tuple[float, str]]) -> list[float]:
    times = [t for t, _ in lines]
    return [round(b - a, 2) for a, b in itertools.pairwise(times)]


@pytest.mark.timeout(180)
def test_quick_demo_prints_a_start_line_at_once_and_progress_every_few_seconds(tmp_path):
    pytest.importorskip("gymnasium", reason="the demo extra is not installed")
    lines, code = timed_lines(["-m", "rlink_ucx", "demo", "--quick", "--plain", "--max-seconds", "20",
                               "--transport", "tcp", "--out", str(tmp_path / "demo")], 150, tmp_path)  # fmt: skip
    assert code in (0, 2), lines
    first_at, first = lines[0]
    assert first.startswith("[rlink demo] starting: PPO on CartPole-v1, 2 actor processes"), lines
    assert first_at < 6.0, lines  # before torch is imported (about 0.6 s on an idle machine)
    assert any(text.startswith("[rlink demo] learner on 127.0.0.1:") for _, text in lines), lines
    # Up to the last progress line (then the summary): never 10 s without a line.
    progress = [(t, text) for t, text in lines if text.startswith("[rlink demo]")]
    assert len(progress) >= 4, lines
    assert max(gaps(progress)) <= 10.0, (gaps(progress), lines)


@pytest.mark.timeout(120)
def test_example_learner_says_it_started_and_prints_a_line_every_10_s_without_actors(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    lines, code = timed_lines(["examples/learner.py", "--address", address], 34, tmp_path)
    assert code is None, lines  # no actor: it waits, printing
    first_at, first = lines[0]
    assert first == "learner starting (loading torch and the policy)", lines
    assert first_at < 6.0, lines
    assert lines[1][1].startswith(f"learner on {address}; start actors with:"), lines
    waiting = lines[2:]
    assert len(waiting) >= 2, lines
    assert all(text == "update 0: 0 env steps, mean return 0.0, lag 0.00, 0 actors" for _, text in waiting), lines
    assert max(gaps(lines[1:])) <= 11.0, (gaps(lines[1:]), lines)  # 10 s, and a busy machine's scheduling

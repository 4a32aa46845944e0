"""Nothing the user should know about is silent: steps dropped at close() warn, and a fetch
timeout gives the time the call really waited."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import rlink_ucx
from rlink_ucx import Actor, Learner, RLinkDataset, RLinkWarning, TimeoutError
from tests.integration.procs import restartable_learner
from tests.integration.test_reliability import free_port

SPAWN = mp.get_context("spawn")


@pytest.mark.timeout(120)
def test_steps_dropped_at_close_warn_with_an_rlink_warning():
    port, deliveries = free_port(), SPAWN.Queue()
    learner = SPAWN.Process(target=restartable_learner, args=(port, deliveries, 1))
    learner.start()
    try:
        assert deliveries.get(timeout=60)[0] == "ready"
        actor = Actor(f"127.0.0.1:{port}", transport="tcp", actor_id=5)
        actor.put({"x": np.int64(0)})
        actor.flush(30)
        os.kill(learner.pid, signal.SIGSTOP)  # it acknowledges nothing more
        for i in range(1, 6):
            actor.put({"x": np.int64(i)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # as a user's interpreter has it
            actor.close(timeout=0.5)
    finally:
        os.kill(learner.pid, signal.SIGCONT)
        learner.kill()
        learner.join(30)
    ours = [w for w in caught if issubclass(w.category, RLinkWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    text = str(ours[0].message)
    assert text.startswith("actor 5 closed with 5 of 6 steps not acknowledged by the learner"), text
    assert "TimeoutError" in text
    assert ours[0].filename == __file__, "the warning points at the caller's close()"


def test_rlink_warning_is_exported_and_shown_on_stderr_by_default():
    assert "RLinkWarning" in rlink_ucx.__all__ and issubclass(RLinkWarning, UserWarning)
    # A fresh interpreter with Python's default filters prints it; a filter on the class silences it.
    code = "import warnings, rlink_ucx; {}warnings.warn('dropped', rlink_ucx.RLinkWarning)"
    shown = subprocess.run([sys.executable, "-c", code.format("")], check=False, capture_output=True, text=True, timeout=60)
    assert "RLinkWarning: dropped" in shown.stderr
    ignore = "warnings.simplefilter('ignore', rlink_ucx.RLinkWarning); "
    quiet = subprocess.run([sys.executable, "-c", code.format(ignore)], check=False, capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.timeout(120)
def test_a_fetch_timeout_reports_the_whole_wait_when_the_schema_came_late():
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=8)
        outcome: list = []
        started = threading.Event()

        def fetch() -> None:
            started.set()
            t0 = time.monotonic()
            try:
                dataset.fetch(timeout=4)
            except TimeoutError as exc:
                outcome.append((str(exc), time.monotonic() - t0))

        reader = threading.Thread(target=fetch)
        reader.start()
        started.wait(10)
        t_start = time.monotonic()
        with Actor(learner.address, transport="tcp") as actor:
            # The first step (and with it the schema) arrives well into the fetch's 4 s.
            while time.monotonic() - t_start < 2.0:
                time.sleep(0.05)
            actor.put({"x": np.float32(1.0)})
            actor.flush(30)
            reader.join(60)
    assert len(outcome) == 1, outcome
    message, waited = outcome[0]
    match = re.fullmatch(r"fetch timed out after ([0-9.]+)s with 1 of 8 steps ready", message)
    assert match, message
    said = float(match.group(1))
    assert 4.0 <= said <= waited + 0.01, (said, waited)

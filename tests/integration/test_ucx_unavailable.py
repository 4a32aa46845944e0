"""UCX that will not start (here: a ``UCX_*`` variable UCX rejects) is a clear, immediate
error on the side where it fails, never a silent retry until ``connect_timeout``: a learner
asked for ``transport="ucx"`` fails at construction; a learner that only offers ucx refuses
the actors that require it, saying why; an actor whose own UCX fails is rejected at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import IO

import numpy as np
import pytest

from rlink_ucx import Actor, ConfigError, ConnectError, Learner, RLinkDataset
from tests.conftest import ucx_importable

pytestmark = pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")

BAD = {"UCX_RNDV_THRESH": "intra:1m"}  # UCX wants a value for "inter" too: its parser refuses this
CONNECT_TIMEOUT = 60.0  # what a silent retry would cost; every failure below must come far sooner


def broken_env() -> dict[str, str]:
    """This environment with the bad variable, and this checkout importable."""
    return {**os.environ, **BAD, "PYTHONPATH": os.getcwd()}


def run_python(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=broken_env(), capture_output=True,
                          text=True, check=False, timeout=timeout)  # fmt: skip


def connect_with_broken_ucx(address: str, transport: str) -> tuple[str, str]:
    """Connect an actor whose UCX cannot start (in a process of its own): its ConnectError, as
    ``"CONNECT-ERROR: <type> <message>"``, and its log. It must fail far sooner than a retry
    until ``connect_timeout`` would."""
    started = time.monotonic()
    done = run_python(
        f"""
        import logging
        from rlink_ucx import Actor, Config, ConnectError
        logging.basicConfig(level=logging.ERROR)
        try:
            Actor({address!r}, transport={transport!r}, insecure=True, config=Config(connect_timeout={CONNECT_TIMEOUT}))
        except ConnectError as exc:
            print("CONNECT-ERROR:", type(exc).__name__, exc)
        """,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < CONNECT_TIMEOUT / 2
    return next(x for x in done.stdout.splitlines() if x.startswith("CONNECT-ERROR:")), done.stderr


@pytest.mark.timeout(120)
def test_a_learner_asked_for_ucx_that_cannot_start_it_raises_a_config_error_naming_the_variable():
    started = time.monotonic()
    done = run_python(
        """
        import os, threading, time
        from rlink_ucx import ConfigError, Learner
        fds = len(os.listdir("/proc/self/fd"))
        try:
            Learner("127.0.0.1:0", transport="ucx", insecure=True)
        except ConfigError as exc:
            print("CONFIG-ERROR:", exc)
        time.sleep(0.5)  # the I/O thread's exit
        print("LEFT:", sorted(t.name for t in threading.enumerate()), len(os.listdir("/proc/self/fd")) - fds)
        """,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("CONFIG-ERROR:"))
    assert "transport='ucx'" in line and "UCX did not start" in line
    assert "UCX_RNDV_THRESH=intra:1m" in line  # the culprit is named
    # ...and the half-started learner is undone: its listener, its threads
    assert next(x for x in done.stdout.splitlines() if x.startswith("LEFT:")) == "LEFT: ['MainThread'] 0"
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_an_actor_whose_ucx_cannot_start_is_rejected_at_once_and_the_learner_serves_others():
    with Learner("127.0.0.1:0", transport="auto", insecure=True) as learner:
        line, _ = connect_with_broken_ucx(learner.address, "ucx")
        assert "Rejected" in line and "on this actor UCX did not start" in line
        assert "UCX_RNDV_THRESH=intra:1m" in line
        # The learner's own UCX is fine: an actor with a working UCX streams over it.
        dataset = RLinkDataset(learner, batch_size=10)
        with Actor(learner.address, transport="ucx", insecure=True) as actor:
            actor.put_many({"x": np.arange(10, dtype=np.int64)})
            actor.flush(timeout=30)
            assert dataset.fetch(timeout=30)["x"].tolist() == list(range(10))
            assert [a["transport"] for a in learner.stats()["actors"]] == ["ucx"]


LEARNER_WITHOUT_UCX = """
    import logging, sys
    from rlink_ucx import Learner, RLinkDataset
    logging.basicConfig(level=logging.WARNING)
    with Learner("127.0.0.1:0", transport="auto", insecure=True) as learner:
        print("ADDRESS", learner.address, flush=True)
        dataset = RLinkDataset(learner, batch_size=10)
        print("FETCHED", dataset.fetch(timeout=60)["x"].tolist(), flush=True)
        print("TRANSPORTS", sorted(a["transport"] for a in learner.stats()["actors"]), flush=True)
        sys.stdin.read()  # until the test is done with us
"""


def tagged_line(stream: IO[str], tag: str) -> str:
    """The rest of the next line starting with ``tag`` (UCX prints its own errors on stdout)."""
    for line in stream:
        if line.startswith(tag + " "):
            return line[len(tag) + 1 :].strip()
    raise AssertionError(f"the learner exited before printing {tag}")


@pytest.mark.timeout(120)
def test_a_learner_whose_ucx_cannot_start_refuses_actors_that_require_it_and_serves_the_others():
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LEARNER_WITHOUT_UCX)], env=broken_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None
        address = tagged_line(proc.stdout, "ADDRESS")
        from rlink_ucx import Config

        started = time.monotonic()
        with pytest.raises(ConnectError, match="ucx requested: the learner's ucx is off .*UCX did not start") as caught:
            Actor(address, transport="ucx", insecure=True, config=Config(connect_timeout=CONNECT_TIMEOUT))
        assert time.monotonic() - started < CONNECT_TIMEOUT / 2, caught.value
        assert "UCX_RNDV_THRESH=intra:1m" in str(caught.value)  # the culprit reaches the actor
        with Actor(address, transport="tcp", insecure=True) as actor:  # the learner still serves
            actor.put_many({"x": np.arange(10, dtype=np.int64)})
            actor.flush(timeout=30)
            assert tagged_line(proc.stdout, "FETCHED") == str(list(range(10)))
            assert tagged_line(proc.stdout, "TRANSPORTS") == "['tcp']"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert err.count("the ucx data plane is off for this learner") == 1  # said once, on the learner's side


@pytest.mark.timeout(120)
def test_an_auto_actor_whose_ucx_cannot_start_stops_offering_ucx_and_says_why_when_only_ucx_would_do():
    with Learner("127.0.0.1:0", transport="ucx", insecure=True) as learner:
        line, log = connect_with_broken_ucx(learner.address, "auto")
        # First try: the learner chose ucx, this actor's UCX did not start: said, and retried
        # without ucx; second try: the learner requires ucx, so it refuses, saying why.
        assert "reconnecting without ucx" in log and "UCX_RNDV_THRESH=intra:1m" in log
        assert "Rejected" in line and "the actor offers none" in line and "UCX did not start there" in line


@pytest.mark.timeout(120)
def test_a_ucx_learner_that_cannot_listen_leaves_no_thread_or_descriptor_behind():
    with Learner("127.0.0.1:0", transport="tcp", insecure=True) as taken:
        threads, fds = {t.name for t in threading.enumerate()}, len(os.listdir("/proc/self/fd"))
        with pytest.raises(ConfigError, match="cannot listen"):
            Learner(taken.address, transport="ucx", insecure=True)  # the port is in use
        deadline = time.monotonic() + 10
        while ({t.name for t in threading.enumerate()} - threads or len(os.listdir("/proc/self/fd")) > fds) \
                and time.monotonic() < deadline:  # fmt: skip
            time.sleep(0.1)
        assert {t.name for t in threading.enumerate()} - threads == set()
        assert len(os.listdir("/proc/self/fd")) <= fds

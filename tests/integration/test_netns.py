"""Two "hosts": learner and actor in separate network namespaces joined by a veth pair.

Needs root and iproute2 (`ip netns`); skipped otherwise. The link is cut for longer than the
heartbeat timeout mid-stream, then restored: the actor reconnects over the real (non-loopback)
addresses with its token and every step is delivered exactly once. And ``Config.tcp_congestion``
on such a link: the system's default unless a name is given (loopback alone gets Reno).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tests.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    tag = uuid.uuid4().hex[:6]
    a, b = f"rlA{tag}", f"rlB{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", a)
        ip("link", "set", vb, "netns", b)
        ip("-n", a, "addr", "add", "10.77.0.1/24", "dev", va)
        ip("-n", b, "addr", "add", "10.77.0.2/24", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, va
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def killed_at_exit(*procs: subprocess.Popen):
    """Whatever happens in the block, no process is left behind."""
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()


def exits_cleanly(proc: subprocess.Popen, timeout: float) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]


def run_in(ns: str, call: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = f"from tests.integration.procs import *; {call}"
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.mark.timeout(180)
def test_link_cut_between_two_hosts_reconnects_and_delivers_everything_once(two_hosts, tmp_path):
    ns_learner, ns_actor, dev = two_hosts
    token, n = "netns-" + uuid.uuid4().hex, 40_000
    progress, learned, acted = tmp_path / "progress", tmp_path / "learner.json", tmp_path / "actor.json"
    learner = run_in(ns_learner, f"netns_learner('10.77.0.1:7443', {token!r}, {n}, {str(progress)!r}, {str(learned)!r})")
    wait_for(lambda: progress.exists() or learner.poll() is not None, 60, "the learner did not start")
    actor = run_in(ns_actor, f"netns_actor('10.77.0.1:7443', {token!r}, {n}, {str(acted)!r})")
    with killed_at_exit(actor, learner):
        deadline = time.monotonic() + 60
        def received() -> int:  # the learner rewrites the file: it may be caught empty
            text = progress.read_text() if progress.exists() else ""
            return int(text) if text.strip().isdigit() else 0

        while received() <= 3000:
            assert time.monotonic() < deadline and learner.poll() is None, "no data crossed the link"
            time.sleep(0.05)
        ip("-n", ns_learner, "link", "set", dev, "down")  # cut until the learner finds the actor lost
        lost = progress.with_name(progress.name + ".lost")
        wait_for(lambda: lost.exists() or learner.poll() is not None, 60, "the learner never found the actor lost")
        ip("-n", ns_learner, "link", "set", dev, "up")
        exits_cleanly(actor, 120)
        exits_cleanly(learner, 120)
    got, stats = json.loads(learned.read_text()), json.loads(acted.read_text())
    seqs = sorted(got["seqs"])
    assert len(seqs) == n and all(s == i for i, s in enumerate(seqs)), "lost or duplicated steps"
    assert got["address"] == "10.77.0.1:7443"
    assert stats["reconnects"] >= 1 and stats["steps_lost"] == 0, stats
    assert any(a["state"] == "lost" for a in got["ended"]), "the cut was not noticed by the learner"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["auto", "reno"])
def test_tcp_congestion_on_a_link_between_two_hosts(two_hosts, tmp_path, setting):
    ns_learner, ns_actor, _ = two_hosts
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as fh:
        expected = fh.read().strip() if setting == "auto" else setting  # not loopback: the default stays
    token = "netns-" + uuid.uuid4().hex
    learned, acted = tmp_path / "learner.json", tmp_path / "actor.json"
    learner = run_in(ns_learner, f"netns_congestion_learner('10.77.0.1:7444', {token!r}, {setting!r}, {str(learned)!r})")
    listening = learned.with_name(learned.name + ".listening")
    wait_for(lambda: listening.exists() or learner.poll() is not None, 60, "the learner did not start")
    actor = run_in(ns_actor, f"netns_congestion_actor('10.77.0.1:7444', {token!r}, {setting!r}, {str(acted)!r}, "
                             f"{str(learned)!r})")  # fmt: skip
    with killed_at_exit(actor, learner):
        exits_cleanly(actor, 60)
        exits_cleanly(learner, 60)
    assert [json.loads(path.read_text()) for path in (learned, acted)] == [{"congestion": expected}] * 2

"""One slow actor holds back no one: an actor behind a 2 Mbit/s link (``tc tbf``), or one that
holds back the last byte of every frame until just under ``frame_timeout``, beside a fast
actor putting 20 steps a second. The fast actor's put->fetch p99 stays within 100 ms and within
2x of its p99 alone (or 10 ms of it: ``NOISE_MS``); the slow actor's steps all arrive, in
order, each once.

Needs root, iproute2 and tc (skipped otherwise); reuses test_netns.py's two namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import numpy as np
import pytest

from tests.integration.test_netns import exits_cleanly, ip, killed_at_exit, run_in, two_hosts  # noqa: F401

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and tc")

FAST_STEPS = 400  # 20 s at 20 steps a second: a p99 of 390 steps is the 4th worst, not a single hiccup
SLOW, FAST_ALONE, FAST_BESIDE = 3, 1, 2  # who sent a step


def start(ns: str, call: str) -> subprocess.Popen:
    """``call`` of slowlink_procs in namespace ``ns``; RLINK_TOKEN comes with the environment
    (run_in copies it; the test sets it with monkeypatch, so it never outlives the test)."""
    return run_in(ns, f"import tests.integration.slowlink_procs as p; p.{call}")


def wait_for(path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)
    return path.read_text()


# 2x of a p99 of about 1 ms is a scheduler hiccup on 2 shared cores (0.9 ms alone, 4.6 ms
# beside a trickler, seen once): within 2x, or within 10 ms of it. A slow frame holding the
# others back costs hundreds of milliseconds (main: p99 531 ms and 2,385 ms here).
NOISE_MS = 10.0
WARM_UP = 10  # the first steps also wait for the actor's connection and schema: not measured


def p99_ms(steps: list, who: int) -> float:
    return float(np.percentile([lat for w, i, lat in steps if w == who and i >= WARM_UP], 99)) * 1e3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("slow", ["shaped", "trickle"])
def test_a_slow_or_trickling_actor_delays_only_itself(two_hosts, tmp_path, slow, monkeypatch):  # noqa: F811
    ns_learner, ns_actor, _ = two_hosts
    if slow == "shaped":  # the actor's side of the link: 2 Mbit/s out of its namespace
        dev = "vb" + two_hosts[2][2:]
        subprocess.run(["ip", "netns", "exec", ns_actor, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                        "rate", "2mbit", "burst", "4kb", "latency", "500ms"], check=True, timeout=10)  # fmt: skip
    monkeypatch.setenv("RLINK_TOKEN", "slow-" + uuid.uuid4().hex)
    addr_path, stop_learner, stop_slow = tmp_path / "address", tmp_path / "stop-learner", tmp_path / "stop-slow"
    learned = tmp_path / "learner.json"
    learner = start(ns_learner, f"learner({str(addr_path)!r}, {str(stop_learner)!r}, {str(learned)!r})")
    with killed_at_exit(learner):
        address = wait_for(addr_path, learner, 30)
        # The fast actor shares the learner's namespace (an unshaped path); alone first.
        alone = start(ns_learner, f"fast_actor({address!r}, {FAST_ALONE}, {FAST_STEPS}, '/dev/null')")
        with killed_at_exit(alone):
            exits_cleanly(alone, 90)
        slow_out = tmp_path / "slow.json"
        slow_proc = start(ns_actor, f"slow_actor({address!r}, {SLOW}, {str(stop_slow)!r}, {str(slow_out)!r}, "
                                    f"{slow == 'trickle'})")  # fmt: skip
        with killed_at_exit(slow_proc):
            time.sleep(3.0)  # its frames are on their way
            beside = start(ns_learner, f"fast_actor({address!r}, {FAST_BESIDE}, {FAST_STEPS}, '/dev/null')")
            with killed_at_exit(beside):
                exits_cleanly(beside, 90)
            assert slow_proc.poll() is None, slow_proc.communicate()[0][-3000:]
            stop_slow.touch()
            exits_cleanly(slow_proc, 90)
        stop_learner.touch()
        exits_cleanly(learner, 60)
    steps = json.loads(learned.read_text())["steps"]
    alone_p99, beside_p99 = p99_ms(steps, FAST_ALONE), p99_ms(steps, FAST_BESIDE)
    print(f"{slow}: fast actor p99 alone {alone_p99:.1f} ms, beside the slow one {beside_p99:.1f} ms, "
          f"p50 {np.median([lat for w, i, lat in steps if w == FAST_BESIDE and i >= WARM_UP]) * 1e3:.1f} ms; "
          f"slow actor {sum(w == SLOW for w, _, _ in steps)} steps")  # fmt: skip
    for who in (FAST_ALONE, FAST_BESIDE):
        assert [i for w, i, _ in steps if w == who] == list(range(FAST_STEPS))
    sent = json.loads(slow_out.read_text())["sent"]
    assert sent >= 30, "the slow actor hardly sent anything: the test measured nothing"
    assert [i for w, i, _ in steps if w == SLOW] == list(range(sent)), "the slow actor's steps: lost, twice or out of order"
    assert beside_p99 <= 100, f"the fast actor's p99 beside a slow one: {beside_p99:.1f} ms"
    assert beside_p99 <= max(2 * alone_p99, alone_p99 + NOISE_MS), \
        f"p99 {beside_p99:.1f} ms beside a slow actor, {alone_p99:.1f} ms alone"  # fmt: skip

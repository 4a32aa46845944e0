"""One copy of each version per host (``weights/hosts.py``), with real processes.

Each actor runs on a "host" of its own making: a UTS namespace whose host name it sets
(``unshare --uts``), so the learner sees actors of two hosts other than its own, while they
share its network and PID namespace (loopback, and each other's ``/proc/<pid>/fd``). Of each
host's actors one takes every version on its weights stream; the others read its copy. Needs
root (``unshare``); skipped where it cannot run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from rlink_ucx import Learner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = 1 << 20  # float32 values: 4 MiB a version
PER_HOST = 3


def can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname rl-probe"], capture_output=True, timeout=10, check=False)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not can_unshare(), reason="needs unshare --uts (root)")


class HostActor:
    """An actor process on host ``host`` and the lines it printed."""

    def __init__(self, address: str, host: str, actor_id: int, mode: str = "", relay: bool = False):
        self.host, self.actor_id, self.lines = host, actor_id, []
        # Without relays unless asked: these tests count one copy per host (test_relays.py: relays).
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   RLINK_WEIGHTS_RELAY="1" if relay else "0")  # fmt: skip
        self.proc = subprocess.Popen(
            ["unshare", "--uts", "sh", "-c",
             'hostname "$0" && exec "$1" -m tests.integration.host_copy_actor "$2" "$3" "$4"',
             host, sys.executable, address, str(actor_id), mode],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def versions(self) -> dict[int, str]:
        return {int(p[1]): p[2] for p in (line.split() for line in list(self.lines)) if p[:1] == ["version"]}

    def stats(self) -> dict:
        found = [line[6:] for line in self.lines if line.startswith("stats ")]
        assert found, self.lines[-20:]
        return json.loads(found[-1])

    def finish(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        self._reader.join(5)
        return code


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def weights_of(version: int) -> dict:
    return {"w": np.full(MODEL, version, np.float32)}


@pytest.mark.timeout(240)
def test_each_host_takes_one_copy_and_another_actor_takes_over_from_a_killed_streamer():
    tag = uuid.uuid4().hex[:6]
    hosts = [f"rl-a-{tag}", f"rl-b-{tag}"]
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish(weights_of(1))
        actors = [HostActor(learner.address, host, 10 * h + i) for h, host in enumerate(hosts) for i in range(PER_HOST)]
        killed = successor = None
        try:
            topology = wait_for(lambda: (t := learner.stats()["weights"]["hosts"]) and all(
                len(t.get(h, {}).get("actors", [])) == PER_HOST for h in hosts) and t, 90, "every actor subscribed")
            assert learner.wait_published(1, timeout=60)
            for host in hosts:  # one streamer per host, one of its own actors
                assert topology[host]["streamer"] in topology[host]["actors"], topology
            bytes_per_version = []
            for version in (2, 3, 4):
                before = learner.stats()["weights"]["streamed_bytes"]
                learner.publish(weights_of(version))
                assert learner.wait_published(version, timeout=60), learner.stats()["weights"]
                bytes_per_version.append(learner.stats()["weights"]["streamed_bytes"] - before)
            model_bytes = MODEL * 4
            # one copy per host, not one per actor (6)
            assert bytes_per_version == [2 * model_bytes] * 3, bytes_per_version
            per_version = learner.stats()["weights"]["bytes_per_version"]
            assert {v: per_version[v] for v in (2, 3, 4)} == {v: 2 * model_bytes for v in (2, 3, 4)}, per_version
            assert all(row["lag"] == 0 for row in learner.stats()["weights"]["hosts"].values())
            assert learner.stats()["weights"]["from_peers"] >= 3 * 2 * (PER_HOST - 1)

            # The streamer of host a dies: another actor of a takes over; nobody misses a version.
            streamer = learner.stats()["weights"]["hosts"][hosts[0]]["streamer"]
            killed = next(a for a in actors if a.actor_id == streamer)
            killed.proc.send_signal(signal.SIGKILL)
            killed.finish(10)
            successor = wait_for(lambda: [s for s in [learner.stats()["weights"]["hosts"][hosts[0]]["streamer"]]
                                          if s not in (None, streamer)], 30, "a new streamer on host a")[0]  # fmt: skip
            assert successor in [a.actor_id for a in actors if a.host == hosts[0] and a is not killed]
            for version in (5, 6):
                before = learner.stats()["weights"]["streamed_bytes"]
                learner.publish(weights_of(version))
                assert learner.wait_published(version, timeout=60), learner.stats()["weights"]
                if version == 6:  # settled: one copy per host again
                    assert learner.stats()["weights"]["streamed_bytes"] - before == 2 * model_bytes
        finally:
            learner.close()
            codes = {a.actor_id: a.finish(60) for a in actors if a is not killed}
    assert all(code == 0 for code in codes.values()), (codes, [a.lines[-5:] for a in actors])
    for actor in actors:
        if actor is killed:
            continue
        got = actor.versions()  # every version it took bit-exact, up to the last one
        assert got and set(got.values()) == {"exact"} and max(got) == 6, (actor.actor_id, got)
    streamers = {topology[h]["streamer"] for h in hosts} | {successor}
    for actor in actors:  # the others read versions 2-6 from a peer's copy, never by stream
        if actor.actor_id not in streamers:
            stats = actor.stats()
            assert stats["shared_reads"] == 5 and stats["streamed"] == 1, (actor.actor_id, stats)


@pytest.mark.timeout(180)
def test_peers_refuse_copies_their_streamer_altered_get_every_version_and_it_is_replaced():
    host = f"rl-c-{uuid.uuid4().hex[:6]}"
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        learner.publish(weights_of(1))
        hostile = HostActor(learner.address, host, 0, "alter")  # first: its host's streamer
        actors = [hostile]
        try:
            wait_for(lambda: learner.stats()["weights"]["hosts"].get(host, {}).get("streamer") == 0, 60, "the streamer")
            actors += [HostActor(learner.address, host, i) for i in (1, 2)]
            wait_for(lambda: len(learner.stats()["weights"]["hosts"][host]["actors"]) == 3, 60, "the peers")
            assert learner.wait_published(1, timeout=60)
            for version in (2, 3, 4):
                learner.publish(weights_of(version))
                assert learner.wait_published(version, timeout=60), learner.stats()["weights"]
            # its copies of versions 2 and 3 were refused: it serves no more; a peer streams for the host
            topology = learner.stats()["weights"]["hosts"][host]
            assert topology["streamer"] in (1, 2) and topology["refused"] == [0], topology
        finally:
            learner.close()
            codes = [a.finish(60) for a in actors]
    assert codes == [0, 0, 0], [a.lines[-5:] for a in actors]
    assert set(hostile.versions().values()) == {"WRONG", "exact"}  # it did alter its copies
    for actor in actors[1:]:
        got = actor.versions()
        assert set(got.values()) == {"exact"} and max(got) == 4, (actor.actor_id, got)
    # Versions 2 and 3: each altered copy refused and taken on a stream instead. Version 4:
    # actor 1 streams it, actor 2 reads actor 1's copy.
    streamer = next(a for a in actors if a.actor_id == topology["streamer"])
    reader = next(a for a in actors[1:] if a is not streamer)
    one, two = streamer.stats(), reader.stats()
    assert (one["rejected"], one["streamed"], one["shared_reads"]) == (2, 4, 0), one
    assert (two["rejected"], two["streamed"], two["shared_reads"]) == (2, 3, 1), two

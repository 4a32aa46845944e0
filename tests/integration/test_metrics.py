"""The learner's Prometheus endpoint, scraped over real HTTP while real actor processes stream
to it over real sockets."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from rlink_ucx import Actor, ConfigError, Learner, RLinkDataset
from rlink_ucx.bench import procfs
from tests.integration.metrics_procs import TOKEN, counting_actor, wrong_token_actor
from tests.sockets import ipv6_loopback
from tests.waiting import wait_until

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

SPAWN = mp.get_context("spawn")
STEP_BYTES = 8 + 4 * 4  # x: int64, obs: 4 float32


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """Every sample the endpoint serves: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def value(samples: dict, name: str, **labels: str) -> float:
    labels.setdefault("rank", "0")  # every series carries the learner's rank
    return samples[(name, tuple(sorted(labels.items())))]


def listening_ports() -> set[int]:
    """TCP ports this process listens on."""
    return set(procfs.listening_ports())


@pytest.mark.timeout(180)
def test_scraped_values_match_what_the_actors_put_and_the_dataset_fetched():
    import torch

    n_actors, n_steps, batch_size = 3, 1000, 100
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0) as learner:
        assert learner.metrics_address is not None
        dataset = RLinkDataset(learner, batch_size=batch_size)
        results, leave = SPAWN.Queue(), SPAWN.Event()
        procs = [SPAWN.Process(target=counting_actor, args=(learner.address, a, n_steps, results, leave))
                 for a in (1, 2, 3)]  # fmt: skip
        for p in procs:
            p.start()
        try:
            fetched = 0
            for _ in range(n_actors * n_steps // batch_size):
                fetched += len(dataset.fetch(timeout=60).seq)
            assert sorted(results.get(timeout=60) for _ in procs) == [("flushed", a) for a in (1, 2, 3)]
            version = learner.publish({"w": torch.arange(10, dtype=torch.float32)})
            bad = SPAWN.Process(target=wrong_token_actor, args=(learner.address, results))
            bad.start()
            assert results.get(timeout=60)[0] == "AuthError"
            bad.join(30)

            m = scrape(learner.metrics_address)
            assert value(m, "rlink_up") == 1
            assert value(m, "rlink_connected_actors") == n_actors
            assert value(m, "rlink_steps_received_total") == n_actors * n_steps == fetched
            assert value(m, "rlink_bytes_received_total") == n_actors * n_steps * STEP_BYTES
            for a in ("1", "2", "3"):
                assert value(m, "rlink_actor_steps_received_total", actor=a) == n_steps
                assert value(m, "rlink_actor_bytes_received_total", actor=a) == n_steps * STEP_BYTES
            assert value(m, "rlink_policy_version") == version == 1
            assert value(m, "rlink_weights_published_total") == 1
            assert value(m, "rlink_publish_seconds_count") == 1
            assert value(m, "rlink_auth_failures_total") == 1
            assert value(m, "rlink_receive_to_fetch_seconds_count") == fetched
            assert value(m, "rlink_receive_to_fetch_seconds_bucket", le="+Inf") == fetched
            assert 0 < value(m, "rlink_receive_to_fetch_seconds_sum") < 60 * fetched
            # put -> fetch holds receive -> fetch and the wire before it (one host: one clock)
            assert value(m, "rlink_put_to_fetch_seconds_count") == fetched
            received = value(m, "rlink_receive_to_fetch_seconds_sum")
            assert received <= value(m, "rlink_put_to_fetch_seconds_sum") + 1e-3 * fetched < 60 * fetched
            assert value(m, "rlink_fetch_seconds_count") == n_actors * n_steps // batch_size
            assert value(m, "rlink_fetched_staleness_bucket", le="0.0") == fetched  # all fetched before the publish
            assert value(m, "rlink_lost_steps_total") == value(m, "rlink_torn_frames_total") == 0
            assert value(m, "rlink_ready_steps") == 0
        finally:
            leave.set()
            for p in procs:
                p.join(30)
        assert [p.exitcode for p in procs] == [0] * n_actors
        # The actors said goodbye: their sessions ended, and no counter went down with them.
        assert wait_until(lambda: value(scrape(learner.metrics_address), "rlink_connected_actors") == 0, 30)
        m = scrape(learner.metrics_address)
        assert value(m, "rlink_steps_received_total") == n_actors * n_steps
        assert value(m, "rlink_actor_steps_received_total", actor="2") == n_steps
        assert value(m, "rlink_lost_sessions_total") == 0
        address = learner.metrics_address
    with pytest.raises(urllib.error.URLError):  # closing the learner stopped its endpoint
        scrape(address)


@pytest.mark.timeout(60)
def test_metrics_are_off_by_default_and_open_no_port():
    before = listening_ports()
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        assert learner.metrics_address is None
        assert listening_ports() - before == {learner.port}
        assert not any(t.name == "rlink-metrics" for t in threading.enumerate())
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0) as learner:
        metrics_port = int(learner.metrics_address.rsplit(":", 1)[1])
        assert listening_ports() - before == {learner.port, metrics_port}
    assert wait_until(lambda: listening_ports() - before == set(), 5)


@pytest.mark.timeout(60)
def test_the_endpoint_binds_loopback_unless_told_otherwise():
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0) as learner:
        assert learner._metrics._httpd.socket.getsockname()[0] == "127.0.0.1"
        assert learner.metrics_address.startswith("127.0.0.1:")
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0, metrics_host="0.0.0.0") as learner:
        assert learner._metrics._httpd.socket.getsockname()[0] == "0.0.0.0"  # asked for: all interfaces
        assert value(scrape(learner.metrics_address), "rlink_up") == 1


@pytest.mark.timeout(60)
def test_two_learners_in_one_process_serve_their_own_numbers():
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0) as a, \
         Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0) as b:  # fmt: skip
        dataset = RLinkDataset(a, batch_size=50)
        with Actor(a.address, token=TOKEN, transport="tcp", actor_id=7) as actor:
            actor.put_many({"x": np.arange(50, dtype=np.int64)})
            actor.flush(30)
            dataset.fetch(timeout=30)
        ma, mb = scrape(a.metrics_address), scrape(b.metrics_address)
        assert value(ma, "rlink_steps_received_total") == 50 and value(mb, "rlink_steps_received_total") == 0
        assert value(ma, "rlink_receive_to_fetch_seconds_count") == 50
        assert value(mb, "rlink_receive_to_fetch_seconds_count") == 0


@pytest.mark.timeout(60)
def test_a_metrics_port_in_use_is_a_config_error_and_leaves_nothing_listening():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        before = listening_ports()
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=port)
        assert listening_ports() == before


@pytest.mark.timeout(60)
def test_a_dropped_learner_stops_its_endpoint():
    import gc

    host = "::1" if ipv6_loopback() else "127.0.0.1"  # an IPv6 endpoint too, where the host has one
    learner = Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0, metrics_host=host)
    address = learner.metrics_address
    assert address.startswith("[::1]:" if ":" in host else "127.0.0.1:") and value(scrape(address), "rlink_up") == 1
    del learner  # the endpoint must not keep its learner alive
    gc.collect()
    with pytest.raises(urllib.error.URLError):
        scrape(address)
    assert not any(t.name == "rlink-metrics" for t in threading.enumerate())


@pytest.mark.timeout(60)
def test_cli_learner_serves_metrics():
    env = {**os.environ, "RLINK_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "rlink_ucx", "learner", "--address", "127.0.0.1:0",
                             "--metrics-port", "0", "--seconds", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    try:
        address = None
        for line in proc.stdout:
            if m := re.match(r"metrics on http://(127\.0\.0\.1:\d+)/metrics", line):
                address = m.group(1)
                break
        assert address is not None
        m = scrape(address)
        assert value(m, "rlink_up") == 1 and value(m, "rlink_connected_actors") == 0
    finally:
        proc.terminate()
        proc.wait(30)


_SLOW_CLIENTS = r"""
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
        held.append(s)
    except OSError:
        pass
print(len(held), flush=True)
time.sleep(float(sys.argv[3]))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_user_holding_partial_requests_cannot_exhaust_the_learners_files():
    # Another uid opens 300 connections to the metrics port and never finishes a request.
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", metrics_port=0) as learner:
        port = int(learner.metrics_address.rsplit(":", 1)[1])
        before = len(os.listdir("/proc/self/fd"))
        slow = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                                 "-c", _SLOW_CLIENTS, str(port), "300", "30"],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert int(slow.stdout.readline()) >= 200  # they got through the listen backlog
            held = len(os.listdir("/proc/self/fd")) - before
            assert held <= 8 + 4, f"{held} descriptors held for a slow client"
            # Within the request deadline the slots free up and an honest scrape is answered.
            assert wait_until(lambda: _scrapes(learner.metrics_address), 15)
            results, leave = SPAWN.Queue(), SPAWN.Event()
            proc = SPAWN.Process(target=counting_actor, args=(learner.address, 1, 50, results, leave))
            proc.start()
            dataset = RLinkDataset(learner, batch_size=50)
            assert sorted(dataset.fetch(timeout=60).seq.tolist()) == list(range(50))
            leave.set()
            proc.join(30)
            assert proc.exitcode == 0
        finally:
            slow.kill()
            slow.wait()


def _scrapes(address: str) -> bool:
    try:
        return value(scrape(address), "rlink_up") == 1
    except OSError:
        return False

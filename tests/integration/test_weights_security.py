"""Attacks on the weights path: listeners a stranger could reach, a man in the middle altering
streamed weights, and a fake learner answering weights streams. Real learner and actor
processes over real sockets; the attacker never holds the token."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from rlink_ucx import Learner
from rlink_ucx.bench.procfs import listening_sockets
from tests.integration.test_datapath import join_all
from tests.integration.weights_mitm import WeightsMitm

SPAWN = mp.get_context("spawn")


pytestmark = pytest.mark.usefixtures("weights_over_connections")
TOKEN = "weights-security-test-token-0123456789"


def model(version: int) -> dict[str, torch.Tensor]:
    """A Linear(4, 3) state whose every value says its version."""
    return {"weight": torch.full((3, 4), float(version)), "bias": torch.arange(3, dtype=torch.float32) + version}


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def watch_versions(actor: Any, until: int) -> tuple[dict[int, str], str | None]:
    """A digest of every version ``actor`` is handed up to ``until``, and the error that
    stopped it early, if any."""
    from rlink_ucx import RLinkError

    seen: dict[int, str] = {}
    while not seen or max(seen) < until:
        try:
            state, version = actor.get_remote_model(timeout=60, latest=False)
        except RLinkError as exc:
            return seen, f"{type(exc).__name__}: {exc}"
        if version:  # 0: none here yet
            seen.setdefault(version, digest(state))
        time.sleep(0.005)
    return seen, None


def watching_actor(address: str, results: Any, until: int, leave: Any) -> None:
    """Subscribes, records a digest of every version it is handed, reports."""
    from rlink_ucx import Actor

    with Actor(address, token=TOKEN, transport="tcp", subscribe=True) as actor:
        seen, error = watch_versions(actor, until)
        results.put({"seen": seen, "error": error, "stats": actor.stats()["weights"]})
        leave.wait(60)


def loading_actor(address: str, results: Any) -> None:
    """Loads the learner's model into a module of its own; reports what happened to it."""
    from rlink_ucx import Actor, RLinkError

    net = torch.nn.Linear(4, 3)
    before = digest(net.state_dict())
    with Actor(address, token=TOKEN, transport="tcp") as actor:
        try:
            actor.load_remote_model(net, timeout=6)
            outcome = "loaded"
        except RLinkError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        results.put({"outcome": outcome, "unchanged": digest(net.state_dict()) == before,
                     "loaded": digest(net.state_dict()), "stats": actor.stats()["weights"]})  # fmt: skip


def start(target: Any, *args: Any) -> mp.Process:
    p = SPAWN.Process(target=target, args=args)
    p.start()
    return p


def wait_subscribed(learner: Learner, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(a["subscribed"] for a in learner.stats()["actors"]) < n:
        assert time.monotonic() < deadline, learner.stats()["actors"]
        time.sleep(0.05)


# --- listeners ------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_the_fan_out_opens_no_listener_in_the_learner_or_its_actors():
    """Versions reach actors on connections they open to the learner's own port: nothing else
    listens (a torch.distributed group's listeners took any stranger's connections)."""
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        results, leave = SPAWN.Queue(), SPAWN.Event()
        procs = [start(watching_actor, learner.address, results, 3, leave) for _ in range(2)]
        wait_subscribed(learner, 2)
        for v in (1, 2, 3):
            assert learner.publish(model(v), wait=True, timeout=60) == v
        ports = listening_sockets()
        actor_ports = [listening_sockets(p.pid) for p in procs]
        streams = learner.stats()["weights"]["streams"]
        reports = [results.get(timeout=60) for _ in procs]
        leave.set()
        assert join_all(procs) == [0, 0]
    assert ports == {("127.0.0.1", learner.port)}, ports
    assert actor_ports == [set(), set()], actor_ports
    assert streams == 2
    for r in reports:
        assert r["error"] is None and r["stats"]["connections"] == 1 and r["stats"]["streamed"] == 3, r
        assert 3 in r["seen"] and all(d == digest(model(v)) for v, d in r["seen"].items()), r["seen"]


# --- a stream's first version -------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_first_version_altered_on_the_way_is_refused_and_nothing_is_loaded():
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        learner.publish(model(1))
        mitm = WeightsMitm(learner.port, tamper_streams=True)
        results = SPAWN.Queue()
        p = start(loading_actor, mitm.address, results)
        report = results.get(timeout=60)
        assert join_all([p]) == [0]
        mitm.close()
    assert mitm.streams_tampered >= 1
    assert report["outcome"].startswith(("ProtocolError", "AuthError")), report
    assert "MAC" in report["outcome"], report
    assert report["unchanged"] and report["stats"]["version"] == 0, report  # no version was exposed
    assert report["stats"]["rejected"] >= 1 and report["stats"]["streamed"] == 0, report


def attacker_model() -> tuple[Any, bytes]:
    """The model a fake learner serves, in the wire format (with its plain checksums where the
    format carries any)."""
    from rlink_ucx.weights.snapshot import BufferPool, snapshot

    fake = snapshot(model(99), 1, 1 << 20, BufferPool())
    return fake.manifest, fake.flat.tobytes()


@pytest.mark.timeout(120)
def test_a_fake_learner_answering_weights_streams_is_refused_and_nothing_is_loaded():
    """The session is with the real learner; only the weights streams reach the fake."""
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        learner.publish(model(1))
        mitm = WeightsMitm(learner.port, fake_streams=attacker_model)
        results = SPAWN.Queue()
        p = start(loading_actor, mitm.address, results)
        report = results.get(timeout=60)
        assert join_all([p]) == [0]
        mitm.close()
    assert mitm.streams_faked >= 1
    assert report["outcome"].startswith("AuthError") and "learner" in report["outcome"], report
    assert report["unchanged"] and report["stats"]["version"] == 0, report  # no version was exposed
    assert report["stats"]["rejected"] >= 1 and report["stats"]["streamed"] == 0, report


# --- streamed versions ----------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_streamed_version_altered_on_the_way_is_refused_and_the_actor_gets_the_real_one():
    """Version 2 is altered on the actor's kept weights stream: the actor refuses it, opens
    a new connection, and gets the real version 2 and then version 3 on it."""
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        mitm = WeightsMitm(learner.port, tamper_once=2)
        results, leave = SPAWN.Queue(), SPAWN.Event()
        p = start(watching_actor, mitm.address, results, 3, leave)
        wait_subscribed(learner, 1)
        for v in (1, 2, 3):
            assert learner.publish(model(v), wait=True, timeout=60) == v
        r = results.get(timeout=60)
        leave.set()
        assert join_all([p]) == [0]
        mitm.close()
    assert mitm.streams_tampered == 1, mitm.streams_tampered
    assert r["error"] is None, r
    assert 3 in r["seen"] and all(d == digest(model(v)) for v, d in r["seen"].items()), r["seen"]
    assert r["stats"]["rejected"] == 1 and r["stats"]["connections"] == 2, r["stats"]
    assert "MAC" in r["stats"]["last_error"], r["stats"]


# --- the data plane's attach --------------------------------------------------------------------
def streaming_actor(address: str, results: Any) -> None:
    """Connects and puts 50 steps; reports how far it got."""
    import numpy as np

    from rlink_ucx import Actor, RLinkError

    try:
        with Actor(address, token=TOKEN, transport="tcp") as actor:
            for i in range(50):
                actor.put({"x": np.full(64, i, dtype=np.float32)})
            actor.flush(timeout=5)
            results.put("flushed")
    except RLinkError as exc:
        results.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.timeout(120)
def test_an_actor_does_not_stream_to_a_data_connection_the_learner_did_not_prove():
    """The man in the middle relays the control connection but takes the data connection
    itself, and tells the actor it is ready: without the learner's proof the actor refuses."""
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        mitm = WeightsMitm(learner.port, fake_data=True)
        results = SPAWN.Queue()
        p = start(streaming_actor, mitm.address, results)
        outcome = results.get(timeout=60)
        assert join_all([p]) == [0]
        time.sleep(0.2)
        mitm.close()
    assert outcome.startswith("AuthError") and "attached" in outcome, outcome
    assert mitm.data_bytes == 0, f"{mitm.data_bytes} bytes of steps went to the man in the middle"

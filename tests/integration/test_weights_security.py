"""Attacks on the weights path: the fan-out group's rendezvous, a man in the middle altering
pulled or broadcast weights, and a fake learner answering pulls. Real learner and actor
processes over real sockets; the attacker never holds the token."""

from __future__ import annotations

import datetime
import hashlib
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import msgspec
import pytest
import torch

from rlink_ucx import Learner
from rlink_ucx.weights.snapshot import Snapshot
from rlink_ucx.wire import messages as _wire
from tests.integration.test_datapath import join_all
from tests.integration.weights_mitm import WeightsMitm, plain_checksums

SPAWN = mp.get_context("spawn")


@pytest.fixture(autouse=True)
def broadcast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the broadcast group and pulls, the path of actors on other hosts:
    actors on the learner's host would read its shared memory instead (test_weights_shared.py)."""
    from rlink_ucx.weights import snapshot

    monkeypatch.setattr(snapshot, "shared_available", lambda: False)  # learners made here
    monkeypatch.setenv("RLINK_WEIGHTS_SHARED_MEMORY", "0")  # learners and actors in other processes
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


# --- the rendezvous ------------------------------------------------------------------------------
def listening_ports() -> list[int]:
    """TCP ports this process listens on (the learner lives in the test process)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def store_client(port: int, results: Any) -> None:
    """An unauthenticated TCPStore client on ``port``: reports the keys it lists, or None."""
    import torch.distributed as dist

    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3),
                               wait_for_workers=False)  # fmt: skip
        keys = list(client.list_keys())
        client.set("planted-by-a-stranger", b"x")
        results.put(keys)
    except Exception:  # noqa: BLE001 - not a store (or one that refused us): what we want
        results.put(None)


def store_answers(port: int) -> list[str] | None:
    """What an unauthenticated TCPStore client finds on ``port`` (run apart: a client that
    reached something that is not a store may wait in a read past its own timeout)."""
    results = SPAWN.Queue()
    p = start(store_client, port, results)
    p.join(12)
    if p.is_alive():
        p.kill()
        p.join()
        return None
    return results.get(timeout=5)


@pytest.mark.timeout(180)
def test_no_rendezvous_store_answers_a_client_without_the_token():
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        results, leave = SPAWN.Queue(), SPAWN.Event()
        procs = [start(watching_actor, learner.address, results, 3, leave) for _ in range(2)]
        wait_subscribed(learner, 2)
        for v in (1, 2):
            assert learner.publish(model(v), wait=True, timeout=60) == v
        stats = learner.stats()["weights"]
        assert stats["groups"] >= 1 and stats["backend"] == "gloo", stats  # the group met
        ports = listening_ports()
        found = {port: store_answers(port) for port in ports}
        assert learner.publish(model(3), wait=True, timeout=60) == 3  # the probes broke nothing
        reports = [results.get(timeout=60) for _ in procs]
        leave.set()
        assert join_all(procs) == [0, 0]
    assert learner.port in ports and len(ports) >= 2, ports  # the control listener and gloo's own
    assert all(keys is None for keys in found.values()), f"a store answered without the token: {found}"
    for r in reports:
        assert r["error"] is None and r["stats"]["broadcasts"] >= 1, r
        assert r["seen"][3] == digest(model(3))


# --- pulls --------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_pull_altered_on_the_way_is_refused_and_nothing_is_loaded():
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        learner.publish(model(1))
        mitm = WeightsMitm(learner.port, tamper_pulls=True)
        results = SPAWN.Queue()
        p = start(loading_actor, mitm.address, results)
        report = results.get(timeout=60)
        assert join_all([p]) == [0]
        mitm.close()
    assert mitm.pulls_tampered >= 1
    assert report["outcome"].startswith(("ProtocolError", "AuthError")), report
    assert "MAC" in report["outcome"], report
    assert report["unchanged"] and report["stats"]["version"] == 0, report  # no version was exposed
    assert report["stats"]["rejected"] >= 1 and report["stats"]["pulls"] == 0, report


def attacker_model() -> tuple[Any, bytes]:
    """The model a fake learner serves, in the wire format (with its plain checksums where the
    format carries any)."""
    from rlink_ucx.weights.snapshot import BufferPool, snapshot

    fake = snapshot(model(99), 1, 1 << 20, BufferPool())
    return fake.manifest, fake.flat.tobytes()


@pytest.mark.timeout(120)
def test_a_fake_learner_answering_pulls_is_refused_and_nothing_is_loaded():
    """The session is with the real learner; only the pull connections reach the fake."""
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        learner.publish(model(1))
        mitm = WeightsMitm(learner.port, fake_pulls=attacker_model)
        results = SPAWN.Queue()
        p = start(loading_actor, mitm.address, results)
        report = results.get(timeout=60)
        assert join_all([p]) == [0]
        mitm.close()
    assert mitm.pulls_faked >= 1
    assert report["outcome"].startswith("AuthError") and "learner" in report["outcome"], report
    assert report["unchanged"] and report["stats"]["version"] == 0, report  # no version was exposed
    assert report["stats"]["rejected"] >= 1 and report["stats"]["pulls"] == 0, report


# --- broadcasts ---------------------------------------------------------------------------------
def broadcasts_altered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket the learner broadcasts leaves with its first byte flipped, as if someone
    on the gloo links rewrote it."""
    original = Snapshot.bucket

    def altered(self: Snapshot, start: int, stop: int) -> Any:
        t = original(self, start, stop).clone()
        t[0] ^= 0xFF
        return t

    monkeypatch.setattr(Snapshot, "bucket", altered)


def plain_checksum_forger(learner: Learner) -> Any:
    """Rewrites any plain checksums the learner sends to match the altered broadcast."""

    def altered_sums(version: int, manifest: Any) -> list[int]:
        publisher = learner._server.publisher
        snap = next(s for s in (publisher.latest, publisher.pending) if s is not None and s.version == version)
        flat = bytearray(snap.flat.tobytes())
        for a, _ in manifest.buckets():
            flat[a] ^= 0xFF
        return plain_checksums(manifest, bytes(flat))

    def rewrite(msg: Any) -> Any:
        if isinstance(msg, _wire.Publish) and msg.manifest.checksums:
            sums = altered_sums(msg.manifest.version, msg.manifest)
            return _wire.Publish(msg.generation, msgspec.structs.replace(msg.manifest, checksums=sums))
        if type(msg).__name__ == "Sealed":
            publisher = learner._server.publisher
            manifest = next(s for s in (publisher.latest, publisher.pending) if s and s.version == msg.version).manifest
            return type(msg)(msg.version, altered_sums(msg.version, manifest))
        return msg

    return rewrite


@pytest.mark.timeout(180)
def test_an_altered_broadcast_bucket_is_refused_and_the_actor_pulls_the_real_one(monkeypatch):
    broadcasts_altered(monkeypatch)
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp") as learner:
        mitm = WeightsMitm(learner.port, rewrite=plain_checksum_forger(learner))
        results, leave = SPAWN.Queue(), SPAWN.Event()
        procs = [start(watching_actor, mitm.address, results, 3, leave) for _ in range(2)]
        wait_subscribed(learner, 2)
        for v in (1, 2, 3):
            assert learner.publish(model(v), wait=True, timeout=60) == v
        reports = [results.get(timeout=60) for _ in procs]
        leave.set()
        assert join_all(procs) == [0, 0]
        stats = learner.stats()["weights"]
        mitm.close()
    assert stats["groups"] >= 1, stats  # the broadcast was tried
    for r in reports:
        assert r["error"] is None, r
        assert r["seen"] and all(d == digest(model(v)) for v, d in r["seen"].items()), r["seen"]
        assert r["stats"]["broadcasts"] == 0 and r["stats"]["rejected"] >= 1, r["stats"]
        assert r["stats"]["pulls"] >= 1, r["stats"]
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


def follower(address: str, results: Any, leave: Any) -> None:
    """Subscribes with a short weights timeout; reports its weights stats when told to leave."""
    from rlink_ucx import Actor, Config

    with Actor(address, token=TOKEN, transport="tcp", subscribe=True, config=Config(weights_timeout=5)) as actor:
        deadline = time.monotonic() + 90
        # Polled, not waited on: a waiter killed inside Event.wait leaves Event.set hanging.
        while not leave.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        results.put(actor.stats()["weights"])


def stalling_follower(address: str, results: Any, leave: Any) -> None:
    """A follower whose rendezvous writes never leave: killed while the group forms, it has
    certainly not set its key (a plain follower's could be in flight when it dies)."""
    from rlink_ucx.weights import rendezvous

    rendezvous.RemoteStore.set = lambda self, key, value: time.sleep(60)  # type: ignore[method-assign]
    follower(address, results, leave)


@pytest.mark.timeout(120)
def test_a_member_dying_in_the_rendezvous_does_not_hold_up_the_fan_out(monkeypatch):
    """The store is the learner's: once a member's session ends before it set its rendezvous
    key, the learner stops waiting for it at once (a TCPStore would wait out the group's
    timeout), and the others get the version by pull and the next one in a group without it."""
    from rlink_ucx import Config
    from rlink_ucx.weights import rendezvous

    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=Config(weights_timeout=20)) as learner:
        results, leave = SPAWN.Queue(), SPAWN.Event()
        procs = [start(follower, learner.address, results, leave) for _ in range(2)]
        victim = start(stalling_follower, learner.address, results, leave)
        procs.append(victim)
        wait_subscribed(learner, 3)
        killed: list[float] = []
        original = rendezvous.KeyValue.set

        def set_then_kill(self: Any, key: str, value: bytes) -> None:
            original(self, key, value)
            if killed or "//0/" not in key or key.endswith("/0/0"):
                return
            # The first actor's address is in: kill the member that will never set its own.
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(time.monotonic())

        monkeypatch.setattr(rendezvous.KeyValue, "set", set_then_kill)
        assert learner.publish(model(1), wait=True, timeout=60) == 1
        took = time.monotonic() - killed[0]
        assert learner.publish(model(2), wait=True, timeout=60) == 2
        stats = learner.stats()
        leave.set()
        reports = [results.get(timeout=60) for _ in range(2)]
        codes = join_all(procs)
    assert sorted(codes) == [-signal.SIGKILL, 0, 0], codes
    assert took < 10, f"the fan-out waited {took:.1f}s for a member that was gone (group timeout 20s)"
    assert "ended" in stats["weights"]["last_error"], stats["weights"]
    assert sorted(a["weights_version"] for a in stats["actors"]) == [2, 2]
    assert all(r["version"] == 2 and r["rejected"] == 0 for r in reports), reports

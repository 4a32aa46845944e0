"""Faults on purpose: learner restarts, actor restarts, kills, floods, hostile handshakes."""

from __future__ import annotations

import gc
import hashlib
import hmac
import multiprocessing as mp
import os
import pickle
import resource
import signal
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner, RLinkDataset, Superseded
from rlink_ucx.bench.procfs import listening_sockets
from rlink_ucx.transport.shm import cma
from rlink_ucx.wire import messages as _wire
from tests.conftest import TRANSPORTS, shm_possible, ucx_importable
from tests.integration.procs import (
    big_frame_actor,
    pressing_actor,
    proxied_actor,
    restartable_learner,
    reused_array_actor,
    seq_flood_actor,
    stall_watching_learner,
    steady_actor,
)
from tests.integration.test_datapath import join_all
from tests.sockets import closed_by_peer
from tests.waiting import wait_for

# Actors that reach the learner through a fault proxy connect to the proxy's port, where no
# generated token file is: they are given the learner's token, as a remote actor would be.
PROXY_TOKEN = "fault-proxy-test-token-0123456789"

SPAWN = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def is_run(values: list, start: int, stop: int) -> bool:
    """``values`` is exactly start, start + 1, ..., stop - 1 (compared without a huge assert diff)."""
    return len(values) == stop - start and all(v == start + i for i, v in enumerate(values))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("large", [False, True], ids=["coalesced-steps", "large-puts-kept"])
def test_learner_killed_and_restarted_on_the_same_port_actors_reconnect_and_resend(large, transport):
    port, n, chunk = free_port(), 6000, 20
    first_q, second_q, results = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    first = SPAWN.Process(target=restartable_learner, args=(port, first_q, 20, transport))
    first.start()
    assert first_q.get(timeout=60)[0] == "ready"
    actors = [SPAWN.Process(target=steady_actor, args=(f"127.0.0.1:{port}", a, n, chunk, results, large, transport))
              for a in (1, 2)]  # fmt: skip
    for p in actors:
        p.start()
    before: list = []
    # Both actors are mid-stream: 1,500 steps delivered, some of each (on a busy machine one
    # actor may connect well after the other).
    while len(before) < 1500 or {a for a, _, _ in before} != {1, 2}:
        before += first_q.get(timeout=60)[1]
    first.kill()
    first.join(10)
    second = SPAWN.Process(target=restartable_learner, args=(port, second_q, 20, transport))
    second.start()
    try:
        assert second_q.get(timeout=60)[0] == "ready"
        after: list = []
        last = {1: -1, 2: -1}
        deadline = time.monotonic() + 120
        while min(last.values()) < n - 1:
            assert time.monotonic() < deadline, f"the restarted learner got only up to {last}"
            kind, steps = second_q.get(timeout=60)
            after += steps
            for a, s, _ in steps:
                last[a] = max(last[a], s)
        stats = [results.get(timeout=60) for _ in actors]
        assert join_all(actors) == [0, 0]
    finally:
        second.kill()
        for p in actors:
            p.kill()
    # Every step the new learner delivered, exactly once, with the right value, and per actor a
    # contiguous run up to the end: the actors resent what the old learner never acknowledged.
    assert len(after) == len(set((a, s) for a, s, _ in after))
    assert all(x == s for _, s, x in after)
    for a in (1, 2):
        seqs = sorted(s for b, s, _ in after if b == a)
        assert is_run(seqs, seqs[0], n), f"actor {a}: gap in what the new learner delivered"
        delivered_before = {s for b, s, _ in before if b == a}
        # Whatever the old learner did not deliver was resent, unless it was acknowledged
        # (buffered) by the old learner when it died: those are the only steps that may be lost.
        assert seqs[0] <= max(delivered_before) + 1 + 3 * 1500, (a, seqs[0], max(delivered_before))
    assert all(s["reconnects"] == 1 and s["steps_lost"] == 0 for s in stats), stats


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_actor_replaces_the_old_incarnation_which_is_refused(transport, caplog):
    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=10)
        old = Actor(learner.address, transport=transport, actor_id=5, config=Config(reconnect_timeout=10))
        old.put_many({"x": np.arange(10, dtype=np.int64)})
        old.flush(10)
        new = Actor(learner.address, transport=transport, actor_id=5)
        new.put_many({"x": np.arange(100, 110, dtype=np.int64)})
        new.flush(10)
        with pytest.raises(Superseded):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                old.put_many({"x": np.arange(10, 20, dtype=np.int64)})
                old.flush(1)
                time.sleep(0.05)
        got = [dataset.fetch(timeout=10) for _ in range(2)]
        assert got[0]["x"].tolist() == list(range(10)) and got[1]["x"].tolist() == list(range(100, 110))
        assert got[1].seq.tolist() == list(range(10)), "the new incarnation is a new stream"
        with pytest.raises(Exception):
            dataset.fetch(timeout=0.5)  # nothing from the old incarnation got in
        old.close()
        new.close()
        del old
        gc.collect()  # the refusal was raised to the caller: no asyncio complaint about it when collected
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.timeout(60)
def test_close_from_another_thread_unblocks_put_flush_and_fetch_within_a_second():
    config = Config(buffer_bytes=4096, actor_window_bytes=1024, frame_bytes=512, put_timeout=30, flush_timeout=30)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=8)
        blocked: dict = {}

        def run(name, fn):
            started = time.monotonic()
            try:
                fn()
                blocked[name] = ("returned", time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - the test records what was raised
                blocked[name] = (type(exc).__name__, time.monotonic() - started)

        actor = Actor(learner.address, transport="tcp", config=config)

        def flood():  # nobody consumes: credit runs out and put blocks
            while True:
                actor.put_many({"x": np.zeros((64, 1), np.int64)})

        t = threading.Thread(target=run, args=("put", flood))
        t.start()
        wait_for(lambda: actor.stats()["credit_waits"] > 0 or actor.stats()["credit"] == 0, 10, "put never blocked")
        time.sleep(0.3)
        closed_at = time.monotonic()
        actor.close(timeout=0.1)
        t.join(5)
        assert blocked["put"][0] == "Closed" and time.monotonic() - closed_at < 1.5, blocked

        idle = Learner("127.0.0.1:0")
        idle_ds = RLinkDataset(idle, batch_size=4)
        t = threading.Thread(target=run, args=("fetch", lambda: idle_ds.fetch(timeout=30)))
        t.start()
        time.sleep(0.3)
        closed_at = time.monotonic()
        idle.close()
        t.join(5)
        assert blocked["fetch"][0] == "Closed" and time.monotonic() - closed_at < 1.5, blocked
        del dataset


@pytest.mark.timeout(120)
def test_500_idle_connections_and_a_2_40_byte_claim_are_refused_without_memory_growth():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    config = Config(handshake_timeout=2)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        host, port = learner.address.rsplit(":", 1)
        dataset = RLinkDataset(learner, batch_size=100)
        with Actor(learner.address, transport="tcp") as warm:  # warm up the ring and code paths
            warm.put_many({"x": np.arange(100, dtype=np.int64)})
            warm.flush(10)
        dataset.fetch(timeout=10)
        rss = rss_bytes()
        idle = [socket.create_connection((host, int(port))) for _ in range(500)]
        claim = socket.create_connection((host, int(port)))
        claim.recv(512)
        claim.sendall(_wire.LENGTH.pack(2**31) + b"\x00" * 64)  # pre-auth length far over the cap
        with Actor(learner.address, transport="tcp") as good:  # keeps working meanwhile
            good.put_many({"x": np.arange(1000, dtype=np.int64)})
            good.flush(20)
        got = [dataset.fetch(timeout=10)["x"].tolist() for _ in range(10)]
        assert [x for b in got for x in b] == list(range(1000))
        assert claim.recv(4096) == b"" or True  # refused: closed by the learner (data may precede EOF)
        wait_for(lambda: all(closed_by_peer(s) for s in idle[:20]), 10, "idle connections were not dropped")
        # 500 pre-auth connections cost the learner about 30 MiB (socket and asyncio buffers),
        # and the second in-process actor's frame buffers land here too; a 2**31-byte claim
        # honoured, or growth per connection, would be far above 48 MiB.
        assert rss_bytes() - rss < 48 << 20, "memory grew with idle connections"
        for s in idle + [claim]:
            s.close()


def _handshake_refused(address: str, make_login) -> float:
    host, port = address.rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        challenge = _wire.read_message(s, 512)
        s.sendall(_wire.encode(make_login(challenge)))
        while True:
            try:
                msg = _wire.read_message(s, 1 << 16)
            except (EOFError, OSError):
                break
            assert not isinstance(msg, (_wire.Proof, _wire.Welcome)), "a bad login was accepted"
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_missing_replayed_and_reflected_proofs_are_refused_within_the_handshake_timeout():
    from rlink_ucx.wire import auth as _auth

    token = b"s3cret-token-s3cret"
    config = Config(handshake_timeout=2)
    with Learner("127.0.0.1:0", token=token, config=config) as learner:
        recorded: dict = {}

        def honest_then_record(ch):  # a real login, recorded for a replay
            nonce = os.urandom(32)
            recorded["login"] = _wire.Login(_wire.PROTOCOL_VERSION, nonce, _auth.actor_proof(token, ch.nonce, nonce))
            return recorded["login"]

        host, port = learner.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            ch = _wire.read_message(s, 512)
            s.sendall(_wire.encode(honest_then_record(ch)))
            assert isinstance(_wire.read_message(s, 512), _wire.Proof)
        cases = {
            "no token": lambda ch: _wire.Login(_wire.PROTOCOL_VERSION, os.urandom(32), b""),
            "wrong token": lambda ch: _wire.Login(_wire.PROTOCOL_VERSION, os.urandom(32),
                                                  _auth.actor_proof(b"guess", ch.nonce, os.urandom(32))),
            "replayed": lambda ch: recorded["login"],  # old nonce pair: the learner's nonce is fresh
            "reflected": lambda ch: _wire.Login(_wire.PROTOCOL_VERSION, ch.nonce,
                                                hmac.new(b"x", ch.nonce, hashlib.sha256).digest()),
        }  # fmt: skip
        for name, login in cases.items():
            assert _handshake_refused(learner.address, login) < config.handshake_timeout + 1, name
        assert learner.stats()["auth_failures"] >= 3
        assert learner.stats()["connected_actors"] == 0


@pytest.mark.timeout(60)
def test_a_pickle_payload_on_the_control_channel_is_rejected_and_never_unpickled(tmp_path):
    canary = tmp_path / "canary"

    class Boom:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    payload = pickle.dumps(Boom())
    with Learner("127.0.0.1:0") as learner:
        host, port = learner.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            _wire.read_message(s, 512)
            s.sendall(_wire.LENGTH.pack(len(payload)) + payload)
            reply = _wire.read_message(s, 1 << 16)
            assert isinstance(reply, _wire.Error) and reply.kind == "protocol"
        with Actor(learner.address) as actor:  # the learner is fine
            actor.put({"x": np.int64(1)})
            actor.flush(10)
    assert not canary.exists()


@pytest.mark.timeout(60)
def test_default_bind_is_loopback_in_the_socket_table():
    import torch

    from rlink_ucx.transport import ucx_available

    for transport in ("tcp", "ucx") if ucx_available() else ("tcp",):
        with Learner("127.0.0.1:0", transport=transport) as learner:
            with Actor(learner.address, transport=transport, subscribe=True) as actor:
                actor.put({"x": np.int64(1)})
                actor.flush(30)
                learner.publish({"w": torch.ones(4)}, wait=True, timeout=30)
                actor.get_remote_model(timeout=30)
                mine = _listening_sockets()
                port = int(learner.address.rsplit(":", 1)[1])
                assert mine[port] == "127.0.0.1"
                # UCX's own TCP listeners too (the weights fan-out opens none)
                assert all(addr == "127.0.0.1" for addr in mine.values()), (transport, mine)


def _listening_sockets() -> dict[int, str]:
    """Listening TCP sockets of this process: port -> local address."""
    return {port: address for address, port in listening_sockets()}


def staging_bytes(dataset: RLinkDataset) -> int:
    """The bytes of the dataset's pool of batch staging arrays (``store.gather``)."""
    assembler = dataset._assembler
    return 0 if assembler is None else sum(a.nbytes for st in assembler._pool for a in st.arrays)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_actor_killed_mid_frame_never_yields_a_torn_step_and_resources_return(transport):
    # An 8 MiB ring is wholly touched by the first two victims' steps: later growth is a leak.
    config = Config(buffer_bytes=8 << 20, actor_window_bytes=4 << 20)
    with Learner("127.0.0.1:0", transport=transport, config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=2)
        if transport in ("ucx", "shm"):
            # The process's shm pump (an epoll and a pipe) starts with the first actor of its
            # plane, and UCX maps a first peer's memory: count them in (run alone, this test is first).
            with Actor(learner.address, transport=transport, actor_id=2) as first:
                first.put_many({"x": np.zeros((2, 1 << 15), np.int64)})
            dataset.fetch(timeout=30)
            wait_for(lambda: learner.stats()["connected_actors"] == 0, 10, "the first actor's session did not end")
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # spawn starts it once per process: not the learner's fd
        fds, rss, heap = open_fds(), 0, 0
        # What a dead session holds must go when it ends, not at the next full collection: the
        # collector is off, and Python's own allocations (numpy included) are traced exactly.
        gc.disable()
        tracemalloc.start()
        try:
            for victim_id in (1, 3, 4, 5):  # the first two warm up the ring; the next two must cost nothing
                _kill_a_big_frame_actor_mid_stream(learner, dataset, victim_id, transport)
                wait_for(lambda: open_fds() <= fds, 10, f"file descriptors leaked: {open_fds()} > {fds}")
                if victim_id == 3:
                    rss, heap = rss_bytes(), tracemalloc.get_traced_memory()[0] - staging_bytes(dataset)
            # Less the dataset's staging pool, bounded by construction: it grows by a batch when a
            # batch cannot be lent while the pooled ones are in use, which depends on timing.
            heap_growth = tracemalloc.get_traced_memory()[0] - staging_bytes(dataset) - heap
            rss_growth = rss_bytes() - rss
        finally:
            tracemalloc.stop()
            gc.enable()
        # A session's 1 MiB landing buffer used to outlive it (2 MiB here). RSS is noisier (the
        # ring's spare chunks; UCX keeps ~30 KiB per dead peer process, docs/reliability.md).
        assert heap_growth < 256 << 10, f"the learner's heap grew by {heap_growth} bytes over two killed actors"
        assert rss_growth < 8 << 20, f"learner memory grew by {rss_growth} bytes over two killed actors"
        assert learner.stats()["buffer"]["buffered_bytes"] <= 2 * (1 << 20)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not shm_possible(), reason="no memfd (not Linux)")
def test_large_shm_puts_read_from_the_actors_memory_arrive_once_and_a_killed_actor_tears_nothing():
    n, elements = 12, cma.MIN_BYTES // 8  # 4 MiB steps: read by address (transport/shm/cma.py)
    with Learner("127.0.0.1:0", transport="shm") as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=reused_array_actor, args=(learner.address, n, elements, results))
        proc.start()
        seqs = []
        for _ in range(n):
            b = dataset.fetch(timeout=60)
            seqs.append(int(b.seq[0]))
            assert bool((b["x"][0] == seqs[-1]).all()), "a step changed after put returned"
        assert seqs == list(range(n))
        assert results.get(timeout=60) == n  # every step went by address
        proc.join(30)
        reason = (learner.stats()["actors"] + learner.stats()["ended_actors"])[0]["transport_reason"]
        assert "straight from the actor's memory" in reason
        for victim_id in (3, 4):  # killed while the learner may be reading its memory
            _kill_a_big_frame_actor_mid_stream(learner, dataset, victim_id, "shm", elements)
        # a death mid-read is a lost actor, not a bad address
        assert [e["protocol_errors"] for e in learner.stats()["ended_actors"]] == [0, 0, 0]


def _kill_a_big_frame_actor_mid_stream(learner: Learner, dataset: RLinkDataset, actor_id: int, transport: str,
                                       elements: int = 1 << 15) -> None:  # fmt: skip
    """Stream 256 KiB steps from a fresh actor process, SIGKILL it mid-stream and drain: every
    step yielded is intact, and the learner reports the actor lost."""
    lost_before = learner.stats()["lost_actors"]
    # Frames of four 256 KiB steps cross the dataset's two-step ring chunks: over ucx they land
    # in the session's landing buffer first.
    victim = SPAWN.Process(target=big_frame_actor, args=(learner.address, actor_id, transport, elements))
    victim.start()
    seen = 0
    while seen < 20:
        b = dataset.fetch(timeout=60)
        for s, x in zip(b.seq.tolist(), b["x"]):
            assert bool((x == s).all()), "a step was yielded with bytes from another step"
        seen += len(b.seq)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    victim.close()  # its pipes are this test's, not the learner's: leave them out of the count
    wait_for(lambda: learner.stats()["lost_actors"] == lost_before + 1, 15, "the learner did not report the lost actor")
    lost = next(e for e in learner.stats()["ended_actors"] if e["actor_id"] == actor_id)
    assert lost["state"] == "lost" and lost["error"]
    while True:  # what arrived complete is still delivered, intact; nothing torn
        try:
            b = dataset.fetch(timeout=1)
        except Exception:  # noqa: BLE001 - TimeoutError: drained
            break
        for s, x in zip(b.seq.tolist(), b["x"]):
            assert bool((x == s).all())


@pytest.mark.timeout(120)
def test_a_slow_consumer_keeps_the_learner_within_its_cap_and_actors_see_backpressure():
    cap = 256 << 10
    config = Config(buffer_bytes=cap, actor_window_bytes=64 << 10, frame_bytes=16 << 10)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=256)
        results = SPAWN.Queue()
        procs = [SPAWN.Process(target=pressing_actor, args=(learner.address, a, 6.0, results)) for a in (1, 2, 3)]
        for p in procs:
            p.start()
        wait_for(lambda: learner.stats()["connected_actors"] == 3, 60, "actors did not connect")
        rss, peak, seqs = rss_bytes(), 0, {1: [], 2: [], 3: []}
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            time.sleep(0.3)  # a training step that takes its time
            b = dataset.fetch(timeout=10)
            for a, s, x in zip(b.actor_id.tolist(), b.seq.tolist(), b["x"].tolist()):
                assert s == x
                seqs[a].append(s)
            peak = max(peak, learner.stats()["buffer"]["buffered_bytes"])
        growth = rss_bytes() - rss
        recorded_peak = learner.stats()["buffer"]["peak_buffered_bytes"]
        while any(p.is_alive() for p in procs):  # drain so the actors can flush and finish
            try:
                b = dataset.fetch(timeout=0.5)
            except Exception:  # noqa: BLE001 - TimeoutError: nothing left right now
                continue
            for a, s in zip(b.actor_id.tolist(), b.seq.tolist()):
                seqs[a].append(s)
        reports = [results.get(timeout=60) for _ in procs]
        assert join_all(procs) == [0, 0, 0]
    assert peak <= cap, f"buffered {peak} bytes over the {cap}-byte cap"
    assert peak <= recorded_peak <= cap, (peak, recorded_peak)
    assert growth < 16 << 20, f"learner memory grew by {growth} bytes"
    assert all(r["backpressure"] > 0 for r in reports), reports
    for r in reports:  # each actor's stream arrives in order, without gaps or repeats
        got = seqs[r["actor_id"]]
        assert is_run(got, 0, len(got)) and len(got) == r["steps_acked"], (r["actor_id"], len(got), r["steps_acked"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_frozen_actor_is_declared_lost_by_heartbeat_and_resumes_after_sigcont(transport):
    config = Config(heartbeat_interval=0.2, heartbeat_timeout=1.5)
    with Learner("127.0.0.1:0", transport=transport, config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=256)
        results = SPAWN.Queue()
        # 5 s of putting: frozen within its first second, it resumes with seconds of putting left
        # (or, on a slow machine, in its flush): either way it must reconnect and lose nothing.
        frozen = SPAWN.Process(target=pressing_actor, args=(learner.address, 1, 5.0, results, 30.0, transport))
        frozen.start()
        wait_for(lambda: learner.stats()["total"]["steps"] > 2000, 60, "the actor did not stream")
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(lambda: learner.stats()["lost_actors"] == 1, 10, "a frozen actor was not detected")
            detected = time.monotonic() - stopped
            assert detected < config.heartbeat_timeout + 1.5, detected
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        seqs: list = []
        deadline = time.monotonic() + 60
        while frozen.is_alive() and time.monotonic() < deadline:
            try:
                seqs += dataset.fetch(timeout=0.5).seq.tolist()
            except Exception:  # noqa: BLE001 - TimeoutError between bursts
                continue
        report = results.get(timeout=30)
        assert join_all([frozen]) == [0]
        stats = learner.stats()
    # It came back by itself (reconnect, same incarnation) and nothing was lost or repeated.
    assert report["reconnects"] >= 1 and report["steps_lost"] == 0, report
    everything = sorted(seqs)
    assert is_run(everything, everything[0], everything[0] + len(everything)), "gaps or repeats"
    assert stats["total"]["duplicate_steps"] >= 0 and stats["connected_actors"] == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "fault, transport",
    [(f, "tcp") for f in ("delay", "blackhole", "cut", "duplicate", "truncate")]
    # Over ucx the proxy sits on the control channel only (frames go worker to worker): a
    # one-way blackhole there is harmless (frames arriving count as signs of life, and credit
    # still flows back), so it is the delay and the two-way cut that test the ucx plane.
    + [pytest.param(f, "ucx", marks=TRANSPORTS[1].marks) for f in ("delay", "cut")],
)
def test_a_misbehaving_network_never_duplicates_never_hangs_and_loses_nothing_kept(fault, transport):
    from tests.integration.faultproxy import FaultProxy

    n = 40_000
    config = Config(heartbeat_interval=0.2, heartbeat_timeout=1.5, frame_timeout=2)
    with Learner("127.0.0.1:0", token=PROXY_TOKEN, transport=transport, config=config) as learner:
        host, port = learner.address.rsplit(":", 1)
        proxy = FaultProxy((host, int(port)))
        dataset = RLinkDataset(learner, batch_size=100)
        results = SPAWN.Queue()
        actor = SPAWN.Process(target=proxied_actor, args=(proxy.address, n, results, transport, PROXY_TOKEN))
        actor.start()
        seqs: list = []
        try:
            wait_for(lambda: learner.stats()["total"]["steps"] > 5000, 60, "no data through the proxy")
            proxy.set(fault, delay=0.02 if fault == "delay" else 0.0)
            if fault in ("delay", "blackhole", "cut"):
                time.sleep(3.0)  # longer than the heartbeat timeout
                proxy.set(None)
            deadline = time.monotonic() + 120
            while len(seqs) < n:
                assert time.monotonic() < deadline, f"stuck at {len(seqs)} of {n} steps"
                try:
                    b = dataset.fetch(timeout=1)
                except Exception:  # noqa: BLE001 - TimeoutError while the link recovers
                    continue
                assert (b["x"] == b.seq).all()
                seqs += b.seq.tolist()
            report = results.get(timeout=60)
            assert join_all([actor]) == [0]
        finally:
            actor.kill()
            proxy.close()
        stats = learner.stats()
    assert is_run(sorted(seqs), 0, n) and len(set(seqs)) == n, "a step was duplicated or lost"
    assert report["steps_lost"] == 0, report
    if fault in ("blackhole", "cut", "truncate"):
        assert report["reconnects"] >= 1, report
    if fault == "duplicate":  # a whole frame repeated is dropped as a duplicate; a torn one resets the link
        assert report["reconnects"] >= 1 or stats["total"]["duplicate_steps"] > 0, (report, stats["total"])
    if fault in ("duplicate", "truncate"):
        assert proxy.events, "the fault was never injected"
    assert stats["total"]["lost_steps"] == 0


@pytest.mark.timeout(180)
def test_a_frozen_learner_is_detected_and_the_stream_resumes_exactly_once_after_sigcont(monkeypatch):
    monkeypatch.setenv("RLINK_HEARTBEAT_INTERVAL", "0.2")  # inherited by the spawned processes
    monkeypatch.setenv("RLINK_HEARTBEAT_TIMEOUT", "1.5")
    port, n, chunk = free_port(), 12_000, 20
    deliveries, results = SPAWN.Queue(), SPAWN.Queue()
    learner = SPAWN.Process(target=restartable_learner, args=(port, deliveries))
    learner.start()
    assert deliveries.get(timeout=60)[0] == "ready"
    actor = SPAWN.Process(target=steady_actor, args=(f"127.0.0.1:{port}", 1, n, chunk, results))
    actor.start()
    got: list = []
    try:
        while len(got) < 1500:
            got += deliveries.get(timeout=60)[1]
        os.kill(learner.pid, signal.SIGSTOP)
        time.sleep(3.0)  # twice the heartbeat timeout: the actor gives up on this connection
        os.kill(learner.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not got or max(s for _, s, _ in got) < n - 1:
            assert time.monotonic() < deadline, f"stuck at {len(got)} steps"
            got += deliveries.get(timeout=60)[1]
        stats = results.get(timeout=60)
        assert join_all([actor]) == [0]
    finally:
        os.kill(learner.pid, signal.SIGCONT)
        learner.kill()
        actor.kill()
    seqs = sorted(s for _, s, _ in got)
    assert is_run(seqs, 0, n), "one learner lifetime: every step exactly once"
    assert stats["reconnects"] >= 1 and stats["steps_lost"] == 0, stats


@pytest.mark.timeout(90)
def test_a_paused_learner_does_not_blame_its_actors_for_its_own_silence(monkeypatch):
    # Paused longer than its heartbeat timeout, the learner finds the actor's heartbeats unread
    # in its socket when it resumes. It used to check liveness first and drop the session.
    monkeypatch.setenv("RLINK_HEARTBEAT_INTERVAL", "0.2")  # the learner's, inherited by its process
    monkeypatch.setenv("RLINK_HEARTBEAT_TIMEOUT", "1.0")
    port, deliveries = free_port(), SPAWN.Queue()
    learner = SPAWN.Process(target=restartable_learner, args=(port, deliveries, 1))
    learner.start()
    assert deliveries.get(timeout=60)[0] == "ready"
    try:
        config = Config(heartbeat_interval=0.2, heartbeat_timeout=30)  # the actor waits out the pause
        with Actor(f"127.0.0.1:{port}", transport="tcp", actor_id=3, config=config) as actor:
            actor.put({"x": np.int64(0)})
            actor.flush(10)
            os.kill(learner.pid, signal.SIGSTOP)
            time.sleep(2.5)
            os.kill(learner.pid, signal.SIGCONT)
            time.sleep(1.0)  # several of the learner's liveness rounds
            actor.put({"x": np.int64(1)})
            actor.flush(10)
            stats = actor.stats()
        got: list = []
        while len(got) < 2:
            got += deliveries.get(timeout=30)[1]
    finally:
        os.kill(learner.pid, signal.SIGCONT)
        learner.kill()
    assert [(a, s, x) for a, s, x in got] == [(3, 0, 0), (3, 1, 1)]
    assert stats["reconnects"] == 0, "the learner dropped a live actor after its own pause"


@pytest.mark.timeout(120)
def test_idle_actors_give_their_credit_back_so_a_busy_one_is_not_starved():
    step = {"x": np.zeros(64 << 10, np.uint8)}  # the default 64 MiB buffer holds ~1000 of these
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=63)
        idle = [Actor(learner.address, transport="tcp") for _ in range(3)]
        for a in idle:  # send a little, then sit on the credit they were granted
            for _ in range(63 * 4):
                a.put(step)
            a.flush(15)
        for _ in range(12):
            dataset.fetch(timeout=15)
        busy_done: dict = {}

        def busy() -> None:
            try:
                with Actor(learner.address, transport="tcp", config=Config(put_timeout=15)) as b:
                    for _ in range(63 * 100):
                        b.put(step)
                    b.flush(15)
                busy_done["ok"] = True
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                busy_done["error"] = repr(exc)

        t = threading.Thread(target=busy)
        t.start()
        for _ in range(100):
            dataset.fetch(timeout=20)
        t.join(30)
        assert busy_done == {"ok": True}, busy_done
        held = [a["credit"] for a in learner.stats()["actors"] if a["actor_id"] in {x.actor_id for x in idle}]
        assert max(held) <= learner.stats()["buffer"]["capacity_bytes"] // (64 << 10)
        for a in idle:
            a.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_releases_sockets_and_threads_while_the_objects_are_still_referenced(transport):
    fds, listening, threads = open_fds(), set(_listening_sockets()), threading.active_count()
    learner = Learner("127.0.0.1:0", transport=transport)
    dataset = RLinkDataset(learner, batch_size=10)
    actor = Actor(learner.address, transport=transport)
    actor.put_many({"x": np.arange(10, dtype=np.int64)})
    assert dataset.fetch(timeout=30)["x"].tolist() == list(range(10))
    assert set(_listening_sockets()) > listening
    actor.close()
    learner.close()
    # `learner`, `actor` and `dataset` are still alive here: close() itself must let go of the
    # UCX workers (their TCP listeners), the sockets and the threads, not the garbage collector.
    wait_for(lambda: open_fds() <= fds, 10, f"file descriptors left open: {open_fds()} > {fds}")
    assert set(_listening_sockets()) == listening
    wait_for(lambda: threading.active_count() <= threads, 10, f"threads left: {threading.enumerate()}")
    assert actor.stats()["steps_put"] == 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=pytest.mark.skipif(not shm_possible(),
                                                                                         reason="no memfd"))])
def test_a_large_put_caught_by_a_link_cut_is_resent_after_the_reconnect_not_raised(transport):
    # A put of a frame or more is sent from the caller's arrays (on shm, read from them by
    # address). A link cut in the middle of it used to raise PeerLost out of put, although the
    # arrays were still intact: now the frame is resent once the actor has reconnected.
    from tests.integration.faultproxy import FaultProxy

    n, elements = 24, 1 << 19  # 4 MiB steps
    hb = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    with Learner("127.0.0.1:0", token=PROXY_TOKEN, transport=transport, config=Config(**hb)) as learner:
        host, port = learner.address.rsplit(":", 1)
        proxy = FaultProxy((host, int(port)))
        dataset = RLinkDataset(learner, batch_size=1)
        seqs: list[int] = []
        torn: list[int] = []
        done = threading.Event()

        def consume():
            while not (done.is_set() and len(seqs) + lost[0] >= n):
                try:
                    b = dataset.fetch(timeout=0.5)
                except Exception:  # noqa: BLE001 - a timeout while the link is cut
                    continue
                seqs.append(int(b.seq[0]))
                if not bool((b["x"][0] == b.seq[0]).all()):
                    torn.append(seqs[-1])

        lost = [0]
        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        try:
            config = Config(**hb, reconnect_timeout=30, put_timeout=30, flush_timeout=30)
            with Actor(proxy.address, token=PROXY_TOKEN, transport=transport, actor_id=6, config=config) as actor:
                x = np.empty(elements, np.int64)
                for seq in range(n):
                    if seq == 8:
                        proxy.set("cut")
                        threading.Timer(2.5, proxy.set, (None,)).start()
                    x.fill(seq)  # the array is reused: what was read must be this step's
                    actor.put({"x": x})  # never raises for the cut
                actor.flush(30)
                stats = actor.stats()
            lost[0] = stats["steps_lost"]
            done.set()
            consumer.join(30)
        finally:
            done.set()
            proxy.close()
    assert stats["reconnects"] >= 1, stats
    assert not torn, f"steps delivered with another step's bytes: {torn}"
    assert seqs == sorted(set(seqs)), "a step was duplicated or reordered"
    # Steps whose put had returned before the cut were not kept (large puts are not copied):
    # those the cut took are counted, never silent; the put caught by it was resent.
    assert len(seqs) + stats["steps_lost"] == n, (len(seqs), stats["steps_lost"])
    assert seqs[-1] == n - 1


@pytest.mark.timeout(60)
def test_a_link_cut_during_the_first_schema_negotiation_is_ridden_out():
    from tests.integration.faultproxy import FaultProxy

    hb = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.5}
    with Learner("127.0.0.1:0", token=PROXY_TOKEN, transport="tcp", config=Config(**hb)) as learner:
        host, port = learner.address.rsplit(":", 1)
        proxy = FaultProxy((host, int(port)))
        dataset = RLinkDataset(learner, batch_size=1)
        try:
            config = Config(**hb, handshake_timeout=20, reconnect_timeout=30)
            with Actor(proxy.address, token=PROXY_TOKEN, transport="tcp", actor_id=4, config=config) as actor:
                proxy.set("cut")  # the first put's proposal is swallowed, and so is the answer
                threading.Timer(3.0, proxy.set, (None,)).start()
                actor.put({"x": np.int64(42)})  # negotiates the schema: must survive the reconnect
                actor.flush(20)
                assert actor.stats()["reconnects"] >= 1
            assert dataset.fetch(timeout=10)["x"].tolist() == [42]
        finally:
            proxy.close()


@pytest.mark.timeout(90)
def test_an_actor_resumes_soon_after_a_cut_link_is_restored():
    # Reconnect attempts made while the link is cut are swallowed whole. Each one used to wait
    # the full connect + handshake timeouts (here 30 s + 30 s, so that the learner does not end
    # it sooner either), so the stream stayed stalled that long after the link came back.
    from tests.integration.faultproxy import FaultProxy

    hb = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    slow = {"connect_timeout": 30, "handshake_timeout": 30}
    with Learner("127.0.0.1:0", token=PROXY_TOKEN, transport="tcp", config=Config(**hb, **slow)) as learner:
        host, port = learner.address.rsplit(":", 1)
        proxy = FaultProxy((host, int(port)))
        dataset = RLinkDataset(learner, batch_size=1)
        try:
            config = Config(**hb, **slow, reconnect_timeout=60, flush_timeout=60)
            with Actor(proxy.address, token=PROXY_TOKEN, transport="tcp", actor_id=5, config=config) as actor:
                actor.put({"x": np.int64(0)})
                actor.flush(10)
                proxy.set("cut")
                wait_for(lambda: not actor.stats()["connected"], 10, "the actor did not notice the cut")
                attempts = proxy.accepted
                # Its next reconnect attempt runs into the cut (swallowed whole), and a little later
                # the one after it: the stall this test is about.
                wait_for(lambda: proxy.accepted >= attempts + 2, 30, "the actor made no reconnect attempts")
                proxy.set(None)
                restored = time.monotonic()
                actor.put({"x": np.int64(1)})
                actor.flush(60)
                resumed = time.monotonic() - restored
                assert actor.stats()["reconnects"] >= 1
            assert [dataset.fetch(timeout=10)["x"].item() for _ in range(2)] == [0, 1]
        finally:
            proxy.close()
    assert resumed < 12, f"the stream resumed {resumed:.1f}s after the link was restored"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")
def test_a_ucx_actor_whose_session_ends_mid_send_reconnects_at_once(monkeypatch):
    # The learner refuses the header of the third 4 MiB frame and ends the session, so the
    # actor's payload send never completes. The actor used to spin in it until frame_timeout
    # (30 s here) with its I/O loop blocked, unable to read the learner's EOF.
    from rlink_ucx import errors as _errors
    from rlink_ucx.session.learner import session as _session

    real_begin, refused = _session.LearnerSession.begin, []

    def begin(self, header):
        if self.stats.frames == 2 and not refused:
            refused.append(time.monotonic())
            raise _errors.ProtocolError("refused by the test")
        return real_begin(self, header)

    monkeypatch.setattr(_session.LearnerSession, "begin", begin)
    config = Config(frame_timeout=30, heartbeat_timeout=30, resend_large_puts=True)
    with Learner("127.0.0.1:0", transport="ucx", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        with Actor(learner.address, transport="ucx", actor_id=7, config=config) as actor:
            for i in range(6):
                actor.put({"x": np.full(1 << 19, i, np.int64)})  # 4 MiB: one frame each
            actor.flush(60)
            resumed = time.monotonic() - refused[0]
            stats = actor.stats()
        got = [dataset.fetch(timeout=10)["x"] for _ in range(6)]
    assert [int(x[0, 0]) for x in got] == list(range(6)) and all(bool((x == x[0, 0]).all()) for x in got)
    assert stats["reconnects"] == 1 and stats["steps_lost"] == 0, stats
    assert resumed < 10, f"the actor took {resumed:.1f}s to notice its session had ended"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")
def test_the_first_ucx_actor_does_not_stall_the_learners_event_loop():
    # Importing ucxx and starting the learner's UCX worker took ~0.45 s on the event loop, and
    # every session's heartbeats and credits waited for it. Loading ucxx holds the GIL (0.41 s
    # with a cold page cache, as in CI), so it now happens when the Learner is made, and the
    # worker starts in an executor. The learner runs in a fresh process: ucxx not yet imported.
    results = SPAWN.Queue()
    learner = SPAWN.Process(target=stall_watching_learner, args=(results,))
    learner.start()
    slowest, imported, transports = results.get(timeout=90)
    learner.join(30)
    assert imported and transports == ["ucx"], (imported, transports)
    assert slowest < 0.2, f"the learner's event loop stalled for {slowest:.3f}s"


def _ucx_mappings() -> int:
    """UCX's shared-memory mappings in this process (its own and its peers')."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "ucx" in line or "SYSV" in line)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")
def test_the_learner_recycles_its_ucx_worker_and_a_live_actor_moves_without_loss():
    # A UCX worker keeps two mappings per actor process it talked to, dead or not
    # (docs/reliability.md). After ucx_recycle_after ended sessions the learner starts a
    # fresh worker: the stale mappings go with the old one, and the live actor reconnects.
    n, chunk = 60000, 20  # ~15 s of steps: the actor is still streaming when the worker is recycled
    with Learner("127.0.0.1:0", transport="ucx", config=Config(ucx_recycle_after=3)) as learner:
        dataset = RLinkDataset(learner, batch_size=4096)
        tail = RLinkDataset(learner, batch_size=1)  # the last steps, whatever the batches left
        results, steady_seqs = SPAWN.Queue(), []

        def drain(seconds: float, source: RLinkDataset = dataset) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                try:
                    b = source.fetch(timeout=0.5)
                except Exception:  # noqa: BLE001 - TimeoutError: nothing ready yet
                    continue
                for a, s, x in zip(b.actor_id.tolist(), b.seq.tolist(), b["x"].tolist()):
                    assert s == x, f"actor {a}: step {s} carries {x}"
                    if a == 1:
                        steady_seqs.append(s)

        steady = SPAWN.Process(target=steady_actor, args=(learner.address, 1, n, chunk, results, False, "ucx"))
        steady.start()
        while len(steady_seqs) < 400:
            drain(0.5)
        baseline = _ucx_mappings()
        for victim_id in (2, 3, 4):  # each ends a session on the first worker: the third recycles it
            victim = SPAWN.Process(target=seq_flood_actor, args=(learner.address, victim_id, "ucx"))
            victim.start()
            wait_for(lambda: any(a["actor_id"] == victim_id for a in learner.stats()["actors"]), 30, "victim did not connect")
            drain(1.0)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            victim.close()
            drain(0.5)
        wait_for(lambda: learner.stats()["ucx_workers_recycled"] == 1, 15, "the UCX worker was not recycled")
        deadline = time.monotonic() + 20
        while _ucx_mappings() > baseline + 2:  # the old worker goes once the live actor has moved
            assert time.monotonic() < deadline, f"UCX mappings {_ucx_mappings()}, {baseline} before three dead actors"
            drain(0.2)
        while steady.is_alive() or len(steady_seqs) < n:
            assert time.monotonic() < deadline + 60, f"the live actor's steps stopped at {len(steady_seqs)} of {n}"
            drain(0.2, dataset if steady.is_alive() else tail)
        stats = results.get(timeout=30)
        steady.join(30)
        learner_stats = learner.stats()
    assert is_run(steady_seqs, 0, n), "the live actor's steps were not each delivered once, in order"
    # The live actor's move is not a fault: its old session ended "moved", only the victims "lost".
    ended = {(a["actor_id"], a["state"]) for a in learner_stats["ended_actors"]}
    assert (1, "moved") in ended and {(2, "lost"), (3, "lost"), (4, "lost")} <= ended, ended
    assert learner_stats["lost_actors"] == 3, learner_stats["lost_actors"]
    assert stats["reconnects"] >= 1 and stats["steps_lost"] == 0, stats

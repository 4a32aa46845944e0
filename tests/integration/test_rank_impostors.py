"""Learner ranks a stranger cannot impersonate (issue 48): rank 0 of a job of two (a
LearnerServer on real sockets) takes a rank only from a peer that proves the job's rank token,
which actors do not hold; a live rank's slot is not given to a second registration, whose
relinks back off; a rank's claims on actors rank 0 did not place on it are ignored, and too
many end its link. And a process answering a dead rank's port with an auth error does not end
that rank's actors: they ask rank 0, which places them on a live rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner
from rlink_ucx.session.learner.ranks.link import RankLinkClient
from rlink_ucx.session.learner.server import LearnerServer
from rlink_ucx.transport.loop import IOThread
from rlink_ucx.wire import auth as _auth
from rlink_ucx.wire import messages as _wire
from tests.integration.hostile import RawActor
from tests.integration.test_many_learners import JOB, ROOT, clean_env, free_port, logs, wait_files

TOKEN = b"impostor-test-actor-token-0123456789"
RANK_TOKEN = b"impostor-test-rank-token-0123456789"


@pytest.fixture
def rank0() -> Iterator[tuple[IOThread, LearnerServer]]:
    config = Config(connect_timeout=60, max_connections=8)
    io = IOThread(name="rank0-io")
    server = LearnerServer("127.0.0.1", 0, token=TOKEN, transport="tcp", config=config, loop=io.loop, rank=0, world=2)
    io.call(server.start(RANK_TOKEN), 30)
    yield io, server
    io.call(server.stop(), 10)
    io.stop(5)


def login(port: int, mac: Callable[[bytes, bytes], bytes]) -> tuple[socket.socket, bytes, bytes]:
    """A control connection to rank 0 and a Login whose mac is ``mac(challenge nonce, nonce)``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    challenge = RawActor.recv(sock)
    assert isinstance(challenge, _wire.Challenge), challenge
    nonce = _auth.new_nonce()
    RawActor.send(sock, _wire.Login(_wire.PROTOCOL_VERSION, nonce, mac(challenge.nonce, nonce)))
    return sock, challenge.nonce, nonce


def refusal(sock: socket.socket) -> _wire.Error:
    """The Error the learner ends a connection with (heartbeats skipped)."""
    while True:
        msg = RawActor.recv(sock)
        if isinstance(msg, _wire.Error):
            sock.close()
            return msg
        assert isinstance(msg, _wire.Heartbeat), msg


def link(io: IOThread, server: LearnerServer, advertised_port: int, serving: Callable[[], set[int]]) -> RankLinkClient:
    """A rank link client (the real one) on rank 0's loop, linking as rank 1."""

    async def start() -> RankLinkClient:
        client = RankLinkClient(1, 2, ("127.0.0.1", server.port), ("127.0.0.1", advertised_port), (TOKEN, RANK_TOKEN),
                                server.config, serving)  # fmt: skip
        RUNNING[client] = server._spawn(client.run())
        return client

    return io.call(start(), 10)


RUNNING: dict[RankLinkClient, asyncio.Task[None]] = {}  # each test link's task


def end_links(io: IOThread, *clients: RankLinkClient) -> None:
    """Close test links and end their tasks (a link attempt in flight included), as a
    learner's stop does."""

    async def stop_them() -> None:
        for client in clients:
            client.close()
            RUNNING.pop(client).cancel()

    io.call(stop_them(), 10)


def wait_for(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_holder_of_the_actor_token_only_can_neither_register_as_a_rank_nor_claim_actors(rank0):
    _, server = rank0
    # Logged in with the actor token's proof, then a RankHello: refused.
    sock, theirs, ours = login(server.port, lambda c, n: _auth.actor_proof(TOKEN, c, n))
    assert isinstance(RawActor.recv(sock), _wire.Proof)
    RawActor.send(sock, _wire.RankHello(1, 2, "127.0.0.1", 4242, _auth.rank_actor_token_proof(TOKEN, theirs, ours)))
    error = refusal(sock)
    assert error.kind == "auth" and "rank token" in error.text, error
    # The actor token in place of the rank token: refused at the login.
    sock, _, _ = login(server.port, lambda c, n: _auth.rank_proof(TOKEN, c, n))
    error = refusal(sock)
    assert error.kind == "auth" and "did not match" in error.text, error
    # Claims on actors over an actor's connection: refused (only a linked rank reports actors).
    sock, _, _ = login(server.port, lambda c, n: _auth.actor_proof(TOKEN, c, n))
    assert isinstance(RawActor.recv(sock), _wire.Proof)
    RawActor.send(sock, _wire.RankActors([1, 2, 3]))
    error = refusal(sock)
    assert error.kind == "protocol" and "expected Hello" in error.text, error
    assert server.ranks is not None and set(server.ranks.links) == {0} and server.ranks.placed == {}
    assert server.admission.auth_failures == 2


@pytest.mark.timeout(90)
def test_a_live_rank_keeps_its_slot_a_second_registration_backs_off_and_claims_are_checked(rank0):
    io, server = rank0
    assert server.ranks is not None
    rank1 = Learner("127.0.0.1:0", token=TOKEN, transport="tcp")  # where actors placed on rank 1 would go
    claims: set[int] = set()
    try:
        real = link(io, server, rank1.port, lambda: set(claims))
        wait_for(real.linked.is_set, 20, "the real rank 1 did not link")
        # Another process holding the rank token registers as rank 1 again, and keeps trying.
        second = link(io, server, 4242, set)
        window = 4.0
        time.sleep(window)  # the attempts in this window are what is measured
        attempts = second.attempts
        print(f"second registration: {attempts} attempts in {window:g}s")
        assert "linked already" in second.last_error, second.last_error
        # Backoff from 0.1 s doubling to 5 s (jittered): a handful of attempts, not a storm.
        assert 2 <= attempts <= 8, attempts
        assert real.links == 1 and real.linked.is_set() and second.links == 0
        assert server.ranks.links[1].port == rank1.port  # the slot is the real rank's
        # The impostor stops here: otherwise it may take the slot while the real rank's link is
        # remade below (a free slot goes to whoever holding the rank token registers first).
        end_links(io, second)
        # Claims on actors rank 0 never placed on rank 1 are ignored.
        claims.update({777, 778})
        wait_for(lambda: server.ranks.refused_claims >= 2, 10, "the claims were not seen")
        assert 777 not in server.ranks.placed and 778 not in server.ranks.placed
        # More claims than max_connections end the link (it is remade, and the link's claims
        # are checked again).
        claims.update(range(1000, 1100))
        wait_for(lambda: real.links >= 2, 20, "a link claiming 102 actors of max_connections=8 was kept")
        assert all(a not in server.ranks.placed for a in claims)

        end_links(io, real)
    finally:
        rank1.close()


def squatter(port: int, stop: threading.Event, seen: list[str]) -> threading.Thread:
    """A process that took ``port``: challenges each connection as a learner would, then
    answers its Login with an auth error."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(16)
    listener.settimeout(0.2)

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(5)
                    try:
                        RawActor.send(conn, _wire.Challenge(_wire.PROTOCOL_VERSION, _auth.new_nonce(), True))
                        seen.append(type(RawActor.recv(conn)).__name__)
                        RawActor.send(conn, _wire.Error("auth", "actor: token proof did not match (wrong token?)"))
                    except OSError:
                        continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_a_squatter_on_a_dead_rank_s_port_does_not_end_its_actors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    master = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with open(tmp_path / "rank1.log", "w") as out:
        rank1 = subprocess.Popen([sys.executable, str(JOB), "--out", str(tmp_path), "--versions", "0", "--seconds",
                                  "200"], cwd=ROOT, env=clean_env(RANK="1", **master), stdout=out,
                                 stderr=subprocess.STDOUT)  # fmt: skip
    for name in list(os.environ):
        if name.startswith(("RLINK_", "TORCHELASTIC", "SLURM_", "LOCAL_")):
            monkeypatch.delenv(name)
    for name, value in {"RANK": "0", **master}.items():
        monkeypatch.setenv(name, value)
    actors: list[Actor] = []
    stop = threading.Event()
    seen: list[str] = []
    try:
        with Learner("127.0.0.1:0", distributed=True, transport="tcp") as learner:  # waits for rank 1 to link
            wait_files(tmp_path, ["rank1.started.json"], 30, [rank1])
            rank1_port = json.loads((tmp_path / "rank1.started.json").read_text())["port"]
            config = Config(reconnect_timeout=60)
            actors = [Actor(learner.address, transport="tcp", config=config) for _ in range(2)]
            for actor in actors:
                actor.put({"x": np.zeros(2, np.float32)})
                actor.flush(timeout=30)
            moved = next(a for a in actors if a.stats()["learner_rank"] == 1)
            rank1.send_signal(signal.SIGKILL)
            rank1.wait(10)
            squatter(rank1_port, stop, seen)
            for _ in range(20):  # the connection to the dead rank breaks; the actor finds the squatter
                moved.put({"x": np.ones(2, np.float32)})
            moved.flush(timeout=90)
            assert seen and set(seen) == {"Login"}, seen  # it did try the squatter, which refused it
            assert moved.stats()["learner_rank"] == 0
            assert moved.actor_id in {a["actor_id"] for a in learner.stats()["actors"]}
            moved.put({"x": np.ones(2, np.float32)})
            moved.flush(timeout=30)  # and it keeps streaming
    except BaseException:
        print(logs(tmp_path))
        raise
    finally:
        stop.set()
        for actor in actors:
            actor.close()
        rank1.kill()

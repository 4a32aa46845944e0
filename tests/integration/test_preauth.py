"""Connections that never authenticate, attacking: a thousand idle sockets against a learner
with few actor slots, a flood from one address against another peer's handshake, and a
silent socket against the pre-auth timeout. Real learner and actor processes on loopback."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import resource
import socket
import time

import pytest

from rlink_ucx import Config, Learner, RLinkDataset
from rlink_ucx.wire import auth as _auth
from rlink_ucx.wire import messages as _wire
from tests.integration.security_procs import timed_actor

SPAWN = mp.get_context("spawn")
TOKEN = b"preauth-tests-token-0123456789"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _login(sock: socket.socket, token: bytes) -> _wire.Message:
    """Answer the challenge already read into ``sock.challenge`` and return the reply."""
    nonce = os.urandom(32)
    sock.sendall(_wire.encode(_wire.Login(_wire.PROTOCOL_VERSION, nonce, _auth.actor_proof(token, sock.challenge.nonce, nonce))))
    return _wire.read_message(sock, 1 << 16)


class _Client(socket.socket):
    challenge: _wire.Challenge


def _connect(host: str, port: int, source: str | None = None) -> _Client:
    sock = _Client(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    if source is not None:
        sock.bind((source, 0))
    sock.connect((host, port))
    return sock


@pytest.mark.timeout(120)
def test_1100_idle_sockets_do_not_lock_a_real_actor_out(caplog):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    caplog.set_level(logging.WARNING, logger="rlink_ucx.session.learner.admission")
    config = Config(max_connections=2)  # few actor slots; every other cap at its default
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        host, port = learner.address.rsplit(":", 1)
        dataset = RLinkDataset(learner, batch_size=500)
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(1100)]
        try:
            wait_for(lambda: learner.stats()["shed_handshakes"] >= 1100 - config.max_handshakes_per_peer, 20,
                     "the learner did not shed the idle sockets")  # fmt: skip
            results = SPAWN.Queue()
            proc = SPAWN.Process(target=timed_actor, args=(learner.address, 500, results))
            proc.start()
            kind, connect_s, deliver_s = results.get(timeout=60)
            assert kind == "ok", (kind, connect_s)
            assert dataset.fetch(timeout=30)["x"].tolist() == list(range(500))
            proc.join(10)
            stats = learner.stats()
        finally:
            for s in idle:
                s.close()
    print(f"under 1100 idle sockets: connected in {connect_s * 1000:.0f} ms, delivered 500 steps in "
          f"{deliver_s * 1000:.0f} ms; shed {stats['shed_handshakes']}")  # fmt: skip
    assert connect_s < 5, f"the actor waited {connect_s:.1f}s behind idle sockets"
    assert stats["handshakes_in_flight"] <= config.max_handshakes_per_peer, stats
    assert stats["shed_handshakes_per_peer"] >= 1100 - config.max_handshakes_per_peer, stats
    warnings = [r for r in caplog.records if r.name == "rlink_ucx.session.learner.admission"]
    assert 1 <= len(warnings) <= 3, [r.getMessage() for r in warnings]  # logged, rate-limited


@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_peer, survives", [(4, True), (16, False)], ids=["per-peer-cap", "global-cap-only"])
def test_a_flood_from_one_address_cannot_push_out_another_peers_handshake(per_peer, survives):
    # 16 handshakes in flight at most. With a per-peer cap of 4, a flood from 127.0.0.2 churns
    # through its own connections; with none (16, the global cap), the flood pushes out the
    # oldest handshake of all: the honest one, whose login is slow (the control case).
    config = Config(max_handshakes=16, max_handshakes_per_peer=per_peer, handshake_timeout=30, preauth_timeout=30)
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=config) as learner:
        host, port = learner.address.rsplit(":", 1)
        honest = _connect(host, int(port), "127.0.0.1")
        honest.challenge = _wire.read_message(honest, 512)
        flood = [_connect(host, int(port), "127.0.0.2") for _ in range(200)]
        try:
            wait_for(lambda: learner.stats()["shed_handshakes"] >= 200 - 16, 20, "the flood was not shed")
            if survives:
                assert isinstance(_login(honest, TOKEN), _wire.Proof)
            else:
                with pytest.raises((EOFError, OSError)):
                    _login(honest, TOKEN)
            stats = learner.stats()
        finally:
            for s in [honest, *flood]:
                s.close()
    if survives:
        assert stats["shed_handshakes_per_peer"] == 200 - per_peer and stats["handshakes_in_flight"] == per_peer, stats


@pytest.mark.timeout(60)
def test_a_socket_that_never_logs_in_is_dropped_at_the_preauth_timeout():
    config = Config(handshake_timeout=30, preauth_timeout=1.0)
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=config) as learner:
        host, port = learner.address.rsplit(":", 1)
        silent = _connect(host, int(port))
        started = time.monotonic()
        _wire.read_message(silent, 512)  # the challenge, then nothing from us
        reply = _wire.read_message(silent, 1 << 16)
        dropped = time.monotonic() - started
        assert silent.recv(1) == b"", "the connection was not closed"
        silent.close()
        # A connection that has logged in is past the pre-auth deadline: slow from there on
        # (its Hello comes later than preauth_timeout) it is still served.
        slow = _connect(host, int(port))
        slow.challenge = _wire.read_message(slow, 512)
        assert isinstance(_login(slow, TOKEN), _wire.Proof)
        time.sleep(1.5)
        slow.sendall(_wire.encode(_wire.Hello(None, 1, "test", "tcp", False, "elsewhere", 1)))
        welcome = _wire.read_message(slow, 1 << 16)
        slow.close()
        stats = learner.stats()
    assert isinstance(reply, _wire.Error) and reply.kind == "timeout" and "preauth_timeout" in reply.text, reply
    assert 0.9 < dropped < 3.0, f"dropped after {dropped:.1f}s, not at the 1 s pre-auth timeout"
    assert isinstance(welcome, _wire.Welcome), welcome
    assert stats["preauth_timeouts"] == 1, stats

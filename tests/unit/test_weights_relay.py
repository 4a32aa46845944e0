"""Relays between hosts: the learner's chain (``weights/chain.py``: which streamer takes versions
from which, linking, splicing, blame), an actor's relay listener and its readers on real
loopback sockets (``weights/relay.py``: proofs both ways, piece-by-piece forwarding, admission
of strangers, hostile bytes), and the actor's inbox of keys and Seals (``weights/inbox.py``)."""

from __future__ import annotations

import random
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rlink_ucx.config import Config
from rlink_ucx.errors import AuthError, ProtocolError
from rlink_ucx.transport.session_state import SessionState
from rlink_ucx.weights import chain as chain_mod
from rlink_ucx.weights.chain import RELAY_MIN_BYTES, Chain
from rlink_ucx.weights.hosts import STRIKES
from rlink_ucx.weights.inbox import KEEP, Inbox
from rlink_ucx.weights.membership import Membership
from rlink_ucx.weights.relay import MAX_PENDING, PIECE, Incoming, RelayServer, dial, stall_timeout
from rlink_ucx.weights.route import Route, delivery
from rlink_ucx.wire import auth as _auth
from rlink_ucx.wire import keys as _keys
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.manifest import KEYED, Entry, Manifest
from tests import fuzzing as fz
from tests.sockets import closed_by_peer, ipv6_loopback

MODEL = 8 << 20


# --- the learner's chain ------------------------------------------------------------------------
class Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[int, Any]] = []

    def __call__(self, sessions: list[Any], *msgs: Any) -> None:
        self.messages += [(s.id, m) for s in sessions for m in msgs]

    def of(self, kind: type) -> list[tuple[int, Any]]:
        return [(sid, m) for sid, m in self.messages if isinstance(m, kind)]


def streamer(sid: int, host: str, **fields: Any) -> Any:
    member = Membership(subscribed=True, peers=True, streamer=True, relay=True, host=host, key=bytes([sid]) * 32,
                        **fields)  # fmt: skip
    sock = SimpleNamespace(getpeername=lambda: (f"10.0.0.{sid}", 40000 + sid))
    return SimpleNamespace(id=sid, actor_id=100 + sid, state=SessionState.OPEN, weights=member,
                           key=bytes([sid + 100]) * 32, control=SimpleNamespace(sock=sock))  # fmt: skip


def three_hosts() -> dict[int, Any]:
    return {sid: streamer(sid, f"h{sid}") for sid in (1, 2, 3)}


def link_all(chain: Chain, sessions: dict[int, Any], sent: Sent) -> None:
    """Answer every RelayServe and RelayFrom as live actors would."""
    for sid, msg in sent.of(_wire.RelayServe):
        chain.on_relay_at(sessions, sessions[sid], _wire.RelayAt(msg.link, 9000 + sid), sent)
    for sid, msg in sent.of(_wire.RelayFrom):
        if msg.port:
            chain.on_relayed(sessions[sid], _wire.Relayed(msg.session, True))
    sent.messages.clear()


def test_the_streamers_form_a_chain_in_session_order_and_each_downstream_gets_its_relay_key():
    sessions, chain, sent = three_hosts(), Chain(Config()), Sent()
    assert chain.relink(sessions, MODEL, sent) == []
    assert chain.order == [1, 2, 3]
    asked = sent.of(_wire.RelayServe)
    assert [sid for sid, _ in asked] == [1, 2]  # the upstreams of 2 and 3
    assert all(sessions[s].weights.relay_want == s - 1 for s in (2, 3)) and sessions[1].weights.relay_want is None
    for sid, msg in asked:
        chain.on_relay_at(sessions, sessions[sid], _wire.RelayAt(msg.link, 9000 + sid), sent)
    froms = dict(sent.of(_wire.RelayFrom))
    assert sorted(froms) == [2, 3]
    for down, msg in froms.items():
        up = sessions[msg.session]
        assert (msg.session, msg.host, msg.port) == (down - 1, f"10.0.0.{down - 1}", 9000 + down - 1)
        # The downstream unwraps the key its upstream derives from its own session key.
        key = _keys.wrap_relay_key(sessions[down].weights.key, msg.link, msg.wrapped)
        assert key == _keys.relay_key(up.key, msg.link)
        assert msg.wrapped != key
    for down, msg in froms.items():
        assert delivery(sessions[down].weights, None) is Route.STREAM  # until it proves the link
        chain.on_relayed(sessions[down], _wire.Relayed(msg.session, True))
        assert delivery(sessions[down].weights, None) is Route.RELAY
    assert delivery(sessions[1].weights, None) is Route.STREAM
    assert chain.report(sessions) == {"order": ["h1", "h2", "h3"], "from": {"h1": "learner", "h2": "h1", "h3": "h2"}}


def test_a_small_model_or_a_single_host_makes_no_chain():
    sessions, chain, sent = three_hosts(), Chain(Config()), Sent()
    chain.relink(sessions, RELAY_MIN_BYTES - 1, sent)
    assert chain.order == [] and sent.messages == []
    sessions, sent = {1: streamer(1, "h1")}, Sent()
    chain.relink(sessions, MODEL, sent)
    assert chain.order == [] and sent.messages == []
    not_relaying = three_hosts()
    for s in not_relaying.values():
        s.weights.relay = False  # Config(weights_relay=False) on the actors
    chain.relink(not_relaying, MODEL, sent)
    assert chain.order == [] and sent.messages == []


def test_an_answer_for_a_link_never_asked_or_from_the_wrong_actor_is_ignored():
    sessions, chain, sent = three_hosts(), Chain(Config()), Sent()
    chain.relink(sessions, MODEL, sent)
    (sid, msg), _ = sent.of(_wire.RelayServe)
    sent.messages.clear()
    chain.on_relay_at(sessions, sessions[3], _wire.RelayAt(msg.link, 9003), sent)  # not asked of 3
    chain.on_relay_at(sessions, sessions[sid], _wire.RelayAt(b"x" * 32, 9001), sent)  # no such link
    assert sent.messages == []
    chain.on_relayed(sessions[2], _wire.Relayed(3, True))  # a relay it was not sent to
    assert sessions[2].weights.relay_from is None


def test_a_streamer_behind_past_the_stall_time_leaves_the_chain_and_comes_back_once_caught_up(monkeypatch):
    sessions, chain, sent = three_hosts(), Chain(Config(weights_timeout=6.0)), Sent()
    now = [100.0]
    monkeypatch.setattr(chain_mod.time, "monotonic", lambda: now[0])
    chain.relink(sessions, MODEL, sent)
    link_all(chain, sessions, sent)
    middle = sessions[2].weights
    middle.sent, middle.acked = 5, 4  # stopped: sent version 5, never confirmed it
    chain.relink(sessions, MODEL, sent)
    assert chain.order == [1, 2, 3]  # not yet: behind for less than the stall time
    now[0] += stall_timeout(chain.config) + 0.1
    chain.relink(sessions, MODEL, sent)
    assert chain.order == [1, 3]  # spliced out
    assert sessions[3].weights.relay_want == 1 and sessions[3].weights.relay_from is None  # relinked around it
    assert [sid for sid, _ in sent.of(_wire.RelayServe)] == [1]
    unlinked = [(sid, m) for sid, m in sent.of(_wire.RelayFrom) if m.port == 0]
    assert unlinked == [(2, _wire.RelayFrom(0, "", 0, b"", b""))]  # it takes versions from the learner
    assert delivery(middle, None) is Route.STREAM
    link_all(chain, sessions, sent)
    middle.acked = 5  # resumed, caught up
    chain.relink(sessions, MODEL, sent)
    assert chain.order == [1, 2, 3]


def test_a_streamer_behind_the_newest_but_confirming_versions_stays_in_the_chain(monkeypatch):
    """A learner publishing faster than the chain carries: every member is behind the newest,
    each still confirms one version after another."""
    sessions, chain, sent = three_hosts(), Chain(Config(weights_timeout=6.0)), Sent()
    now = [100.0]
    monkeypatch.setattr(chain_mod.time, "monotonic", lambda: now[0])
    for acked in range(1, 10):
        for s in sessions.values():
            s.weights.sent, s.weights.acked = acked + 3, acked
        chain.relink(sessions, MODEL, sent)
        assert chain.order == [1, 2, 3]
        now[0] += stall_timeout(chain.config) * 0.9


def test_a_failed_link_is_tried_again_later_and_later(monkeypatch):
    sessions, chain, sent = three_hosts(), Chain(Config()), Sent()
    now = [50.0]
    monkeypatch.setattr(chain_mod.time, "monotonic", lambda: now[0])
    waits = []
    for _ in range(4):
        chain.relink(sessions, MODEL, sent)
        link = next(m.link for sid, m in sent.of(_wire.RelayServe) if sid == 1)
        chain.on_relay_at(sessions, sessions[1], _wire.RelayAt(link, 0), sent)  # it cannot listen
        sent.messages.clear()
        retry = sessions[2].weights.relay_retry_at - now[0]
        waits.append(retry)
        chain.relink(sessions, MODEL, sent)
        assert not [m for sid, m in sent.of(_wire.RelayServe) if sid == 1]  # not before the retry time
        now[0] += retry + 0.01
    assert waits == pytest.approx([1.0, 2.0, 4.0, 8.0])


def test_only_the_first_reader_that_refused_a_version_strikes_its_relay(monkeypatch):
    """Hosts 1 -> 2 -> 3; host 1 alters what it passes on. Host 2 refuses it, and so does host 3
    (host 2 passed the altered pieces on before it could check them): host 1 is struck, not 2."""
    sessions, chain, sent = three_hosts(), Chain(Config()), Sent()
    now = [10.0]
    monkeypatch.setattr(chain_mod.time, "monotonic", lambda: now[0])
    for version in range(1, STRIKES + 1):
        chain.relink(sessions, MODEL, sent)
        link_all(chain, sessions, sent)
        for sid in (2, 3):  # what the fan-out does for the relayed
            member = sessions[sid].weights
            member.sent, member.relay_read = version, member.relay_from
        # host 3's refusal may well come first
        chain.on_relayed(sessions[3], _wire.Relayed(2, False, version))
        chain.on_relayed(sessions[2], _wire.Relayed(1, False, version))
        for sid in (2, 3):
            sessions[sid].weights.acked = version  # they took it from the learner instead
        assert chain.relink(sessions, MODEL, sent) == []  # no verdict before BLAME_DELAY
        assert sessions[1].weights.relay_strikes == tuple(range(1, version))
        now[0] += chain_mod.BLAME_DELAY + chain_mod.RETRY_SECONDS[0] * 2
        chain.relink(sessions, MODEL, sent)
        assert sessions[2].weights.relay_strikes == ()  # host 2 passed on what it refused itself
        assert sessions[1].weights.relay_strikes == tuple(range(1, version + 1))
    assert sessions[1].weights.suspect and not sessions[1].weights.streamer
    assert chain.order == [2, 3] and not sessions[2].weights.suspect


def test_a_reader_confirming_a_relayed_version_clears_its_relays_strikes():
    sessions, chain, sent = three_hosts(), Chain(Config()), Sent()
    chain.relink(sessions, MODEL, sent)
    link_all(chain, sessions, sent)
    sessions[1].weights.relay_strikes = (4,)
    reader = sessions[2].weights
    reader.sent, reader.relay_read = 5, 1
    Chain.served(sessions, sessions[2], 5)
    assert sessions[1].weights.relay_strikes == () and reader.relay_read is None


# --- an actor's relay listener, on loopback -------------------------------------------------
LINK = bytes(range(32))
SESSION_KEY = b"s" * 32
KEY = _keys.relay_key(SESSION_KEY, LINK)
CONFIG = Config(handshake_timeout=2.0, weights_timeout=6.0, close_timeout=5.0)


def manifest(version: int, nbytes: int) -> Manifest:
    return Manifest(version, [Entry("w", "uint8", [nbytes], 0)], nbytes, 1 << 20, [], KEYED)


@pytest.fixture
def relay():
    server = RelayServer("127.0.0.1", CONFIG)
    assert server.serve(LINK, KEY) == server.port
    yield server
    server.close()


def read_version(sock: socket.socket) -> tuple[int, bytes]:
    msg = _wire.read_message(sock, 1 << 20)
    assert isinstance(msg, _wire.Publish)
    body = bytearray(msg.manifest.total_bytes)
    _wire.recv_exact_into(sock, memoryview(body))
    return msg.manifest.version, bytes(body)


@pytest.mark.timeout(60)
def test_a_reader_proving_the_link_gets_each_piece_as_it_arrives_and_then_newer_versions(relay):
    sock = dial("127.0.0.1", relay.port, LINK, KEY, 0, CONFIG)
    try:
        nbytes = 3 * PIECE + 123
        data = np.frombuffer(random.Random(1).randbytes(nbytes), np.uint8).copy()
        incoming = Incoming(manifest(4, nbytes), data)
        relay.offer(incoming)
        incoming.advance(PIECE)  # only the first piece is in
        msg = _wire.read_message(sock, 1 << 20)
        assert isinstance(msg, _wire.Publish) and msg.manifest.version == 4
        first = bytearray(PIECE)
        _wire.recv_exact_into(sock, memoryview(first))  # forwarded before the rest arrived
        assert bytes(first) == data[:PIECE].tobytes()
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # nothing beyond what arrived
        sock.settimeout(5)
        incoming.advance(nbytes)
        rest = bytearray(nbytes - PIECE)
        _wire.recv_exact_into(sock, memoryview(rest))
        assert bytes(rest) == data[PIECE:].tobytes()
        newer = np.full(PIECE, 7, np.uint8)
        done = Incoming(manifest(5, PIECE), newer)
        done.advance(PIECE)
        relay.offer(done)
        assert read_version(sock) == (5, newer.tobytes())
        assert relay.stats["relayed"] == 2 and relay.stats["readers"] == 1
    finally:
        sock.close()


@pytest.mark.timeout(60)
def test_a_reader_gets_no_version_it_has_and_a_failed_one_ends_its_connection(relay):
    have = Incoming(manifest(3, 4096), np.zeros(4096, np.uint8))
    have.advance(4096)
    relay.offer(have)
    sock = dial("127.0.0.1", relay.port, LINK, KEY, 3, CONFIG)
    try:
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # version 3: it has it
        broken = Incoming(manifest(4, 4 * PIECE), np.zeros(4 * PIECE, np.uint8))
        relay.offer(broken)
        broken.advance(PIECE)
        sock.settimeout(5)
        assert isinstance(_wire.read_message(sock, 1 << 20), _wire.Publish)
        _wire.recv_exact_into(sock, memoryview(bytearray(PIECE)))
        broken.fail()  # this actor's own source broke mid-version
        assert sock.recv(1) == b""  # its reader takes the version elsewhere
    finally:
        sock.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrong", ["key", "link", "proto"])
def test_a_reader_without_the_links_key_is_refused_and_the_relay_is_no_oracle(relay, wrong):
    key = b"x" * 32 if wrong == "key" else KEY
    link = b"y" * 32 if wrong == "link" else LINK
    if wrong == "proto":
        sock = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        challenge = _wire.read_message(sock, 4096)
        mac = _keys.relay_proof(KEY, "reader", challenge.nonce, b"n" * 32)
        sock.sendall(_wire.encode(_wire.RelayOpen(_wire.PROTOCOL_VERSION - 1, LINK, mac, b"n" * 32)))
        assert sock.recv(1) == b""  # closed without a proof
        sock.close()
    else:
        with pytest.raises((AuthError, EOFError, OSError)):
            dial("127.0.0.1", relay.port, link, key, 0, CONFIG)
    wait(lambda: relay.stats["refused"] == 1)
    assert relay.stats["readers"] == 0


def test_a_relay_that_cannot_prove_the_key_is_refused_by_its_reader():
    """A stranger listening where the reader was sent (it answers with a proof of another key)."""
    fake = RelayServer("127.0.0.1", CONFIG)
    try:
        fake.serve(LINK, b"z" * 32)  # not the link's key: its proof cannot verify
        with pytest.raises((AuthError, EOFError, OSError)):
            dial("127.0.0.1", fake.port, LINK, KEY, 0, CONFIG)
    finally:
        fake.close()


def wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_strangers_holding_connections_open_hold_at_most_max_pending_and_a_reader_still_gets_in():
    patient = Config(handshake_timeout=60.0, weights_timeout=6.0, close_timeout=5.0)  # no deadline in this test
    relay = RelayServer("127.0.0.1", patient)
    relay.serve(LINK, KEY)
    held = [socket.create_connection(("127.0.0.1", relay.port), timeout=5) for _ in range(4 * MAX_PENDING)]
    try:
        # The listener closes all but the newest MAX_PENDING (the oldest go first), long before
        # any handshake deadline.
        wait(lambda: sum(1 for s in held if closed_by_peer(s)) == 3 * MAX_PENDING)
        assert [closed_by_peer(s) for s in held] == [True] * (3 * MAX_PENDING) + [False] * MAX_PENDING
        sock = dial("127.0.0.1", relay.port, LINK, KEY, 0, patient)  # a reader gets in regardless
        sock.close()
    finally:
        for s in held:
            s.close()
        relay.close()


@pytest.mark.timeout(60)
def test_a_connection_that_does_not_prove_itself_in_time_is_closed(relay):
    before = open_fds()
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
        assert isinstance(_wire.read_message(sock, 4096), _wire.Challenge)
        started = time.monotonic()
        sock.settimeout(CONFIG.handshake_timeout + 5)
        assert sock.recv(1) == b""
        # Not before the deadline; soon after it (generous: a loaded machine runs the listener late).
        assert CONFIG.handshake_timeout - 0.3 <= time.monotonic() - started <= CONFIG.handshake_timeout + 4.5
    wait(lambda: open_fds() <= before, timeout=20)


@pytest.mark.timeout(120)
def test_hostile_bytes_at_the_listener_are_refused_and_it_serves_on(relay):
    rng = random.Random(51)
    for _ in range(150):
        raw = fz.hostile_stream(rng, fz.RELAY_TYPES)
        try:
            with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(5)
                while sock.recv(65536):
                    pass  # never a Proof: nobody proved the key
        except OSError:
            pass
    wait(lambda: relay.stats["refused"] >= 100)
    assert relay.stats["readers"] == 0
    sock = dial("127.0.0.1", relay.port, LINK, KEY, 0, CONFIG)
    sock.close()


def test_a_length_claim_past_the_preauth_limit_is_refused_before_it_is_read(relay):
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
        _wire.read_message(sock, 4096)  # the Challenge
        sock.sendall(_wire.LENGTH.pack(CONFIG.max_preauth_bytes + 1))
        sock.settimeout(5)
        assert sock.recv(1) == b""
    wait(lambda: relay.stats["refused"] == 1)


# --- the actor's inbox --------------------------------------------------------------------------
def test_keys_and_seals_wait_by_version_and_other_messages_keep_their_order():
    inbox = Inbox()
    seal5 = _wire.Seal(5, [b"t"], b"m")
    for msg in (_wire.Version(4), _wire.WeightsKey(5, b"w"), _wire.Version(5), seal5, _wire.Seal(3, [], b"")):
        inbox.put(msg)
    assert inbox.wait_for(_wire.Seal, 5, 1.0) is seal5  # past the messages before it
    assert inbox.wait_for(_wire.WeightsKey, 5, 1.0) == _wire.WeightsKey(5, b"w")  # kept meanwhile
    assert inbox.get(0) == _wire.Version(4) and inbox.get(0) == _wire.Version(5)  # in order
    assert inbox.get(0) is None  # keys and Seals never come out of get
    with pytest.raises(ProtocolError, match="no WeightsKey for weights version 6"):
        inbox.wait_for(_wire.WeightsKey, 6, 0.05)


def test_a_key_that_arrives_while_waiting_is_found():
    inbox = Inbox()
    threading.Timer(0.1, inbox.put, args=(_wire.WeightsKey(9, b"w"),)).start()
    assert inbox.wait_for(_wire.WeightsKey, 9, 5.0) == _wire.WeightsKey(9, b"w")


def test_the_inbox_keeps_only_the_newest_keys():
    inbox = Inbox()
    for version in range(1, KEEP + 10):
        inbox.put(_wire.Seal(version, [], b""))
    assert inbox.get(0) is None
    with pytest.raises(ProtocolError):
        inbox.wait_for(_wire.Seal, 1, 0.01)  # dropped: nobody will read it
    assert inbox.wait_for(_wire.Seal, KEEP + 9, 0.01).version == KEEP + 9


def test_relay_nonces_are_fresh():
    assert len(_auth.new_nonce()) == len(LINK)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_relay_on_an_ipv6_address():
    server = RelayServer("::1", CONFIG)
    try:
        server.serve(LINK, KEY)
        sock = dial("::1", server.port, LINK, KEY, 0, CONFIG)
        done = Incoming(manifest(2, 4096), np.full(4096, 3, np.uint8))
        done.advance(4096)
        server.offer(done)
        assert read_version(sock) == (2, bytes([3]) * 4096)
        sock.close()
    finally:
        server.close()

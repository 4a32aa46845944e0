"""The actor's end of its weights stream: the connection it subscribes through, opening a
stream to the learner with both sides proving the session's key, and reading what comes on it
(or on a relay's connection, ``relay.py``)."""

from __future__ import annotations

import hmac
import select
import socket
from collections.abc import Callable
from typing import Any, Protocol

from ..config import Config
from ..errors import AuthError, ProtocolError, RLinkError, refusal
from ..errors import TimeoutError as RLinkTimeout
from ..transport.control import ControlConnection
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire
from .mac import VersionKey

__all__ = ["Connection", "Link", "Unproven", "open_seal", "open_stream", "read_reply", "readable", "tag_completed",
           "timed_out"]


class Link(Protocol):
    """The actor's connection as the subscriber sees it (a ``session.actor.link.ActorConnection``)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def actor_id(self) -> int | None: ...
    @property
    def latest_version(self) -> int:
        """The newest version the learner announced."""
        ...

    @property
    def error(self) -> RLinkError | None:
        """Set once the connection failed for good."""
        ...

    @property
    def welcome(self) -> _wire.Welcome | None:
        """Session id and ticket: opening a weights stream proves them."""
        ...

    @property
    def control(self) -> ControlConnection | None: ...

    weights_listener: Callable[[Any], None] | None  # gets the weights messages
    subscription: Any  # the Subscribe message, repeated after a reconnect

    def weights_key(self) -> bytes:
        """The current session's weights key (``wire.keys.session_key``)."""
        ...


class Unproven(AuthError):
    """The peer answering did not prove the key it had to."""


class Connection:
    """A weights stream's connection and its key (fresh by both nonces), or a relay's, its
    link's key and the relaying actor's session id."""

    __slots__ = ("key", "session", "sock")

    def __init__(self, sock: socket.socket, key: bytes, session: int = 0):
        self.sock, self.key, self.session = sock, key, session


def open_stream(conn: Link, have: int, config: Config) -> Connection:
    """Open a weights stream to the learner: both sides prove the session's weights key over
    fresh nonces first. The learner then sends the newest version newer than ``have`` on it (or,
    to an actor on shared memory with nothing newer, Version and closes it)."""
    welcome = conn.welcome
    assert welcome is not None
    session_key = conn.weights_key()
    sock = socket.create_connection((conn.host, conn.port), timeout=config.handshake_timeout)
    try:
        sock.settimeout(config.weights_timeout)
        challenge = _wire.read_message(sock, config.max_preauth_bytes)
        if not isinstance(challenge, _wire.Challenge):
            raise ProtocolError(f"expected Challenge, got {type(challenge).__name__}")
        nonce = _auth.new_nonce()
        mac = _keys.stream_proof(session_key, "actor", challenge.nonce, nonce, welcome.session)
        sock.sendall(_wire.encode(_wire.OpenStream(_wire.PROTOCOL_VERSION, welcome.session, mac, have, nonce)))
        proof = _wire.read_message(sock, config.max_control_bytes)
        if isinstance(proof, _wire.Error):
            raise refusal(proof.kind, f"learner refused the weights stream: {proof.text}")
        expected = _keys.stream_proof(session_key, "learner", challenge.nonce, nonce, welcome.session)
        if not isinstance(proof, _wire.Proof) or not hmac.compare_digest(expected, proof.mac):
            raise Unproven("the peer answering a weights stream did not prove the session's key (not the learner?)")
    except BaseException:
        sock.close()
        raise
    return Connection(sock, _keys.stream_key(session_key, challenge.nonce, nonce))


def read_reply(sock: socket.socket, kind: Any, max_bytes: int) -> Any:
    """The next message on a weights stream, which must be a ``kind``."""
    msg = _wire.read_message(sock, max_bytes)
    if isinstance(msg, _wire.Error):
        raise refusal(msg.kind, f"learner refused the weights stream: {msg.text}")
    if not isinstance(msg, kind):
        raise ProtocolError(f"weights stream: unexpected {type(msg).__name__}")
    return msg


def tag_completed(buckets: list[tuple[int, int]], tags: list[Any], done: int, tag: Callable[[int, int, int], Any]) -> None:
    """Append ``tag(i, start, end)`` for each bucket ``i`` that the first ``done`` bytes complete."""
    while len(tags) < len(buckets) and buckets[len(tags)][1] <= done:
        i = len(tags)
        tags.append(tag(i, *buckets[i]))


def readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    try:
        return list(select.select(socks, [], [], timeout)[0])
    except (OSError, ValueError):  # closed meanwhile: the read says how
        return socks


def open_seal(key: bytes, manifest: Any, wrapped: _wire.WeightsKey, seal: _wire.Seal) -> VersionKey:
    """The version's key, once the Seal's MAC under ``key`` covers it, its manifest and tags
    (AuthError: it does not)."""
    version = manifest.version
    if wrapped.version != version or seal.version != version:
        raise ProtocolError(f"weights key or Seal for version {seal.version}, expected {version}")
    mac = _keys.seal_mac(key, version, manifest, wrapped.wrapped, list(seal.tags))
    if not hmac.compare_digest(mac, seal.mac):
        raise AuthError(f"weights version {version}: its Seal does not verify under this "
                        "actor's key (not from the learner, or altered)")  # fmt: skip
    return VersionKey(_keys.wrap(key, version, wrapped.wrapped))


def timed_out(newest: int, have: int, rejected: RLinkError | None, newer_than: int | None) -> RLinkError:
    """What an actor's wait for weights that ran out raises: a version refused as altered, else
    a timeout (``newest``: the version the learner announced; ``have``: ours)."""
    if rejected is not None and newest > have:
        return type(rejected)(f"weights version {newest} was refused: {rejected}")
    limit = f"no weights version newer than {newer_than}" if newer_than is not None else "no weights"
    return RLinkTimeout(f"{limit} in time: the learner has version {newest}, this actor "
                        f"{have or 'none'}" + ("" if newest else " (nothing published yet)"))  # fmt: skip

"""Relays between hosts: an actor passes each version it receives on to the next host's actor.

The learner links its hosts' streamers (``hosts.py``) into a chain (``chain.py``): the first
takes each version on its weights stream, every other one from the host before it. A relaying
actor forwards each piece of a version as soon as it is in (:class:`Incoming`), so the version
reaches the last host about one piece after the first, and the learner sends it once.

Only bytes travel on a relay connection: each version's key and Seal still come from the
learner, on the reader's control connection, under the reader's own key. A relay that alters a
byte gets that copy refused by its reader's tags. The connection itself is proven both ways
with a key the learner made for this link from the relay's session key (``RelayServe``,
``RelayFrom``): a stranger learns nothing from it and gets nothing through it.

The listener (:class:`RelayServer`) opens only when the learner first asks this actor to
relay. A stranger can hold at most :data:`MAX_PENDING` of its connections, each for at most
``handshake_timeout``: the oldest goes first, as on the learner's own port.
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import AuthError, ProtocolError, RLinkError
from ..transport.sockopts import set_congestion
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire

__all__ = ["MAX_PENDING", "PIECE", "Incoming", "RelayServer", "dial", "receive", "stall_timeout"]

log = logging.getLogger(__name__)

PIECE = 256 << 10  # bytes received, then forwarded, at a time: the delay one hop adds
MAX_PENDING = 8  # connections still proving themselves; beyond it the oldest is closed
MAX_READERS = 4  # readers served at once (a chain has one; a newer one replaces the oldest)
MAX_LINKS = 8  # relay keys kept: the newest links the learner asked for


class Incoming:
    """A version as it arrives at this actor, for the readers it is passed on to: its manifest,
    its buffer, and how many bytes of it are in (written by the receiving thread only)."""

    def __init__(self, manifest: Any, flat: Any):
        self.manifest, self.flat = manifest, flat
        self.done = 0
        self.failed = False
        self._cv = threading.Condition()

    @property
    def version(self) -> int:
        return int(self.manifest.version)

    def advance(self, done: int) -> None:
        with self._cv:
            self.done = done
            self._cv.notify_all()

    def fail(self) -> None:
        """It will not complete: its readers end their connection (and take it another way)."""
        with self._cv:
            self.failed = True
            self._cv.notify_all()

    def wait_beyond(self, done: int, timeout: float) -> int:
        """The bytes in, once more than ``done`` are (or ``done`` after ``timeout``)."""
        with self._cv:
            if self.done <= done and not self.failed:
                self._cv.wait(timeout)
            if self.failed:
                raise RLinkError(f"version {self.version} did not arrive complete at the relay")
            return self.done


class _Reader:
    """One proven reader's connection and the newest version sent on it."""

    __slots__ = ("sent", "sock", "thread")

    def __init__(self, sock: socket.socket):
        self.sock, self.sent = sock, 0
        self.thread: threading.Thread | None = None


class RelayServer:
    """This actor's relay listener and the readers it passes versions on to."""

    def __init__(self, bind_host: str, config: Config):
        self.config = config
        self._links: dict[bytes, bytes] = {}  # link nonce -> the link's relay key, newest last
        self._cv = threading.Condition()  # guards _links, _readers, _newest
        self._readers: list[_Reader] = []
        self._newest: Incoming | None = None
        self._closed = False
        self.stats = {"readers": 0, "relayed": 0, "refused": 0}
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.create_server((bind_host, 0), family=family, backlog=MAX_PENDING)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._listen, name="rlink-relay", daemon=True)
        self._thread.start()

    def serve(self, link: bytes, key: bytes) -> int:
        """Accept the reader that proves ``key`` for ``link``; returns the listener's port."""
        with self._cv:
            self._links[link] = key
            while len(self._links) > MAX_LINKS:
                del self._links[next(iter(self._links))]
        return int(self.port)

    def offer(self, incoming: Incoming) -> None:
        """``incoming`` is arriving: every reader gets it once it has sent what it is sending."""
        with self._cv:
            if self._newest is None or incoming.version >= self._newest.version:
                self._newest = incoming
            self._cv.notify_all()

    # --- the listener's thread: admission and handshakes ------------------------------------
    def _listen(self) -> None:
        pending: dict[socket.socket, tuple[float, bytes, bytearray]] = {}  # sock -> deadline, nonce, bytes in
        try:
            while not self._closed:
                ready = select.select([self._sock, *pending], [], [], 0.25)[0]
                now = time.monotonic()
                for sock in ready:
                    if sock is self._sock:
                        self._admit(pending, now)
                    elif sock in pending and self._handshake(sock, *pending[sock][1:]):
                        del pending[sock]
                for sock in [s for s, (deadline, *_) in pending.items() if deadline <= now]:
                    del pending[sock]
                    sock.close()
        except (OSError, ValueError):
            pass  # closed
        finally:
            for sock in pending:
                sock.close()

    def _admit(self, pending: dict[socket.socket, Any], now: float) -> None:
        try:
            sock, _ = self._sock.accept()
        except OSError:
            return
        nonce = _auth.new_nonce()
        try:
            sock.setblocking(False)
            sock.send(_wire.encode(_wire.Challenge(_wire.PROTOCOL_VERSION, nonce, True)))
        except OSError:
            sock.close()
            return
        pending[sock] = (now + self.config.handshake_timeout, nonce, bytearray())
        while len(pending) > MAX_PENDING:  # a stranger holding slots: the oldest goes
            oldest = next(iter(pending))
            del pending[oldest]
            oldest.close()

    def _handshake(self, sock: socket.socket, nonce: bytes, got: bytearray) -> bool:
        """Read what arrived of a RelayOpen; once whole, check it and answer. True: ``sock`` is
        done with (served, or closed as unproven); False: more bytes are due."""
        try:
            data = sock.recv(4096)
            if not data:
                raise EOFError("closed before proving itself")
            got += data
            if len(got) < _wire.LENGTH.size:
                return False
            (length,) = _wire.LENGTH.unpack_from(got)
            _wire.check_length(length, self.config.max_preauth_bytes)
            if len(got) < _wire.LENGTH.size + length:
                return False
            msg = _wire.decode(bytes(got[_wire.LENGTH.size : _wire.LENGTH.size + length]))
            key = self._check_open(msg, nonce)
            assert isinstance(msg, _wire.RelayOpen)
            sock.setblocking(True)
            sock.sendall(_wire.encode(_wire.Proof(_keys.relay_proof(key, "relay", nonce, msg.nonce))))
        except (OSError, EOFError, RLinkError) as exc:
            self.stats["refused"] += 1
            log.debug("relay connection refused: %s", exc)
            sock.close()
            return True
        try:
            self._start_reader(sock, msg.have)
        except OSError as exc:  # it went away just now: the listener serves on
            log.debug("relay reader lost at once: %s", exc)
            sock.close()
        return True

    def _check_open(self, msg: Any, nonce: bytes) -> bytes:
        if not isinstance(msg, _wire.RelayOpen) or msg.proto != _wire.PROTOCOL_VERSION:
            raise ProtocolError("not a relay opening of this protocol")
        with self._cv:
            key = self._links.get(msg.link)
        if key is None or len(msg.nonce) != _auth.NONCE_BYTES:
            raise AuthError("relay opening for no link of ours")
        _auth.verify(_keys.relay_proof(key, "reader", nonce, msg.nonce), msg.mac, "relay")
        return key

    # --- readers' threads: forwarding -------------------------------------------------------
    def _start_reader(self, sock: socket.socket, have: int) -> None:
        sock.settimeout(self.config.weights_timeout)  # bounds every send
        set_congestion(sock, self.config.tcp_congestion)
        reader = _Reader(sock)
        reader.sent = max(0, have)  # the reader holds it already
        with self._cv:
            self._readers.append(reader)
            old = self._readers[:-MAX_READERS]
            del self._readers[:-MAX_READERS]
            self.stats["readers"] = len(self._readers)
        for gone in old:
            _shut(gone.sock)
        reader.thread = threading.Thread(target=self._forward, args=(reader,), name="rlink-relay-out", daemon=True)
        reader.thread.start()

    def _next_for(self, reader: _Reader) -> Incoming | None:
        with self._cv:
            while not self._closed and reader in self._readers:
                newest = self._newest
                if newest is not None and newest.version > reader.sent and not newest.failed:
                    return newest
                self._cv.wait(0.25)
        return None

    def _forward(self, reader: _Reader) -> None:
        """Send each newest version to ``reader`` as its pieces arrive here."""
        try:
            while (incoming := self._next_for(reader)) is not None:
                send = reader.sock.sendall
                send(_wire.encode(_wire.Publish(incoming.manifest)))
                total, sent = incoming.manifest.total_bytes, 0
                while sent < total:
                    if self._closed:
                        return
                    done = incoming.wait_beyond(sent, 0.25)
                    if done > sent:
                        send(memoryview(incoming.flat[sent:done]))
                        sent = done
                reader.sent = incoming.version
                self.stats["relayed"] += 1
        except (OSError, RLinkError) as exc:
            log.info("relay to a reader ended: %s", exc)
        finally:
            with self._cv:
                if reader in self._readers:
                    self._readers.remove(reader)
                self.stats["readers"] = len(self._readers)
            reader.sock.close()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            readers = list(self._readers)
            self._cv.notify_all()
        self._sock.close()
        for reader in readers:
            _shut(reader.sock)
        self._thread.join(self.config.close_timeout)
        for reader in readers:
            if reader.thread is not None:
                reader.thread.join(self.config.close_timeout)


def dial(host: str, port: int, link: bytes, key: bytes, have: int, config: Config) -> socket.socket:
    """Connect to a relay and prove ``link``'s key both ways; the connection, ready to read
    versions from (its timeout: how long a read may wait for the relay)."""
    sock = socket.create_connection((host, port), timeout=config.handshake_timeout)
    try:
        challenge = _wire.read_message(sock, config.max_preauth_bytes)
        if not isinstance(challenge, _wire.Challenge):
            raise ProtocolError(f"relay sent {type(challenge).__name__}, not a Challenge")
        nonce = _auth.new_nonce()
        mac = _keys.relay_proof(key, "reader", challenge.nonce, nonce)
        sock.sendall(_wire.encode(_wire.RelayOpen(_wire.PROTOCOL_VERSION, link, mac, nonce, have)))
        proof = _wire.read_message(sock, config.max_preauth_bytes)
        expected = _keys.relay_proof(key, "relay", challenge.nonce, nonce)
        if not isinstance(proof, _wire.Proof) or not hmac.compare_digest(expected, proof.mac):
            raise AuthError("the relay did not prove the link's key")
        sock.settimeout(stall_timeout(config))
    except BaseException:
        sock.close()
        raise
    return sock


def receive(sock: socket.socket, manifest: Any, pool: Any, relay: RelayServer | None,
            on_piece: Callable[[Any, int], None] | None = None) -> tuple[Any, list[Any] | None]:  # fmt: skip
    """Read ``manifest``'s bytes from ``sock`` into a fresh buffer of ``pool``, piece by piece,
    each passed on to ``relay``'s readers as soon as it is in (and to ``on_piece(buffer,
    bytes in)``); the buffer and where it lies (a memfd: the host's other actors may read it)."""
    flat, where = pool.get(manifest.total_bytes)
    incoming = Incoming(manifest, flat)
    if relay is not None:
        relay.offer(incoming)
    total, done = manifest.total_bytes, 0
    try:
        while done < total:
            end = min(total, done + PIECE)
            _wire.recv_exact_into(sock, flat.data[done:end])
            done = end
            incoming.advance(done)
            if on_piece is not None:
                on_piece(flat, done)
    except BaseException:
        incoming.fail()
        raise
    return flat, where


def stall_timeout(config: Config) -> float:
    """How long a reader waits for its relay's next bytes before taking the version from the
    learner instead: well inside ``weights_timeout``, so a stopped relay costs its readers that
    version's detour, not the version."""
    return max(0.5, config.weights_timeout / 6)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

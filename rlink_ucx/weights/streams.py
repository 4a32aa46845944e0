"""The learner's weights streams: each actor's proven connection, and the thread that sends
versions on it.

An actor opens its stream to the learner's port and proves the session's key over fresh nonces
(``OpenStream``); the learner answers with its own proof and hands the connection to a thread of
its own, which sends each version's buckets as soon as they are copied, so the copy of later
buckets overlaps the sending of earlier ones, and a slow actor delays only itself. Whether a
stream stays open after a version is :func:`~.route.delivery`'s to say.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AuthError, RLinkError
from ..transport.session_state import SessionState
from ..transport.sockopts import set_congestion
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire
from .membership import Member
from .route import Route, delivery
from .snapshot import Snapshot

__all__ = ["Streams"]

_ELSEWHERE = (Route.RELAY, Route.BROADCAST)  # routes whose bytes do not come from the learner's streams

log = logging.getLogger(__name__)


@dataclass
class _Opening:
    key: bytes  # the stream's key (fresh by both nonces)
    proof: bytes  # the learner's proof, sent first on the stream


@dataclass
class _Stream:
    """An actor's proven weights stream, owned by its sending thread."""

    session: Member
    sock: socket.socket
    key: bytes  # the stream's key: wraps each version's secret and keys its Seal
    sent: int  # newest version the actor has (or was sent on this stream)
    thread: threading.Thread | None = None
    ended: bool = field(default=False)


class Streams:
    """The weights streams of one publisher (``publisher.Publisher``): its lock guards them."""

    def __init__(self, publisher: Any):
        self.pub = publisher
        self.by_session: dict[int, _Stream] = {}  # session id -> its weights stream
        self._openings: dict[int, _Opening] = {}  # session id -> the stream just proven, until served
        self._host_lock = threading.Lock()  # one host copy per CUDA version

    def verify(self, msg: _wire.OpenStream, nonce: bytes) -> Member:
        """Check a weights stream's opening proof (on the loop, right before :meth:`serve`)."""
        session: Member | None = self.pub.server.sessions.get(msg.session)
        if session is None or session.state is not SessionState.OPEN:
            raise AuthError("weights stream for an unknown session")
        if len(msg.nonce) != _auth.NONCE_BYTES:
            raise AuthError("weights stream without a fresh nonce")
        key = session.key
        _auth.verify(_keys.stream_proof(key, "actor", nonce, msg.nonce, session.id), msg.mac, "weights stream")
        self._openings[session.id] = _Opening(_keys.stream_key(key, nonce, msg.nonce),
                                              _keys.stream_proof(key, "learner", nonce, msg.nonce, session.id))  # fmt: skip
        return session

    async def serve(self, conn: Any, session: Member, have: int) -> None:
        """Answer a proven stream with the learner's proof, then hand the connection to a thread
        of its own (:meth:`_send_versions`): the newest version newer than ``have`` goes out on
        it (or Version if there is none and the actor reads shared memory), and every later
        version too where :func:`~.route.delivery` routes it by stream."""
        opening = self._openings.pop(session.id, None)  # before any await: verify just set it
        if opening is None:
            raise AuthError("weights stream without a verified proof")
        pub = self.pub
        await pub.loop.sock_sendall(conn.sock, _wire.encode(_wire.Proof(opening.proof)))
        conn.handed_off = True  # the stream's thread owns the socket from here on
        sock = conn.sock
        sock.setblocking(True)
        sock.settimeout(pub.config.weights_timeout)  # bounds every send (one bucket)
        set_congestion(sock, pub.config.tcp_congestion)  # whole models go out on it
        stream = _Stream(session, sock, opening.key, have)
        with pub.cv:
            if pub.closed:
                sock.close()
                return
            pub.stream_opened(session, have)
            old = self.by_session.get(session.id)
            self.by_session[session.id] = stream
            pub.stats["streams"] = len(self.by_session)
        if old is not None:  # a reconnected stream replaces the old one: its thread ends
            _shut(old)
        stream.thread = threading.Thread(target=self._send_versions, args=(stream,), daemon=True,
                                         name=f"rlink-weights-{session.id}")  # fmt: skip
        stream.thread.start()

    # --- each stream's thread ---------------------------------------------------------------
    def _send_versions(self, stream: _Stream) -> None:
        pub = self.pub
        try:
            while True:
                snap = self._newer(stream)
                if snap is None:
                    if not self._keeps(stream) and not pub.closed:  # a one-version stream, nothing newer
                        stream.sock.sendall(_wire.encode(_wire.Version(pub.server.version)))
                    return
                self._push(stream, snap)
                if not self._keeps(stream):
                    return
        except (OSError, RLinkError) as exc:
            if not stream.ended and not pub.closed:
                log.info("weights stream of session %d ended: %s", stream.session.id, exc)
        finally:
            _shut(stream)
            stream.sock.close()
            with pub.cv:
                if self.by_session.get(stream.session.id) is stream:
                    del self.by_session[stream.session.id]
                pub.stats["streams"] = len(self.by_session)

    def _keeps(self, stream: _Stream) -> bool:
        """Whether the stream stays open for later versions (else it carries one): where
        :func:`~.route.delivery` routes the newest version to its actor by stream."""
        s, pub = stream.session, self.pub
        # Not ``s.weights.subscribed``: only a subscriber opens a stream, and its Subscribe (on
        # the control connection) may be read after its stream opened (on a connection of its
        # own); a stream ended after one version there left the actor to open a second one.
        with pub.cv:
            return s.state is SessionState.OPEN and delivery(s.weights, pub.pending or pub.latest) is Route.STREAM

    def _newer(self, stream: _Stream) -> Snapshot | None:
        """The newest version newer than the stream's (waiting for one while the stream is
        kept), possibly still being copied; None once the stream should end."""
        pub = self.pub
        with pub.cv:
            while not (pub.closed or stream.ended or stream.session.state is not SessionState.OPEN):
                snap: Snapshot | None = pub.pending if pub.pending is not None and pub.pending.failed is None else pub.latest
                if snap is not None and snap.version > stream.sent:
                    # Linked to a relay (or in the broadcast group) meanwhile: it brings this version; a copy here as well
                    # would race it, and a refused relay copy would go unnoticed.
                    route = delivery(stream.session.weights, snap)
                    if route is Route.BROADCAST and snap.version < stream.session.weights.cast_first:
                        return snap  # routed by stream before the group formed: the group will not bring it
                    return None if route in _ELSEWHERE else snap
                if not self._keeps(stream):
                    return None
                pub.cv.wait(0.25)
        return None

    def _push(self, stream: _Stream, snap: Snapshot) -> None:
        """Send one version: Publish, its key wrapped for this stream, each bucket as soon
        as it is copied, and the Seal once every bucket is tagged."""
        pub = self.pub
        timeout = pub.config.weights_timeout
        source = self._host_copy(snap)  # a CUDA version: once sealed, in host memory
        with pub.cv:
            # Sent from its first byte: an actor stopped mid-version is then behind what it was
            # sent, and its chain's stall rule (``membership.stalled``) can splice it out; noted
            # only once the Seal went out, a stopped chain head was never behind and starved its
            # readers.
            member = stream.session.weights
            member.sent = max(member.sent, source.version)
        send = stream.sock.sendall
        send(_wire.encode(_wire.Publish(source.manifest)) + _wire.encode(pub.weights_key(stream.key, source)))
        for i, (a, b) in enumerate(source.manifest.buckets()):
            source.wait_ready(i + 1, timeout)
            send(memoryview(source.flat[a:b]))
        source.wait_ready(len(source.manifest.buckets()) + 1, timeout)
        send(_wire.encode(pub.seal(stream.key, source)[1]))
        stream.sent = source.version
        with pub.cv:
            pub.stats["streamed"] += 1
            pub.stats["streamed_bytes"] += source.manifest.total_bytes
            sent = pub.stats["bytes_per_version"]  # the learner's own sends, newest versions only
            sent[source.version] = sent.get(source.version, 0) + source.manifest.total_bytes
            for old in [v for v in sent if v <= source.version - 4]:
                del sent[old]

    def _host_copy(self, snap: Snapshot) -> Snapshot:
        """A host copy of a CUDA snapshot, for the weights streams: the one its tags were
        computed on (``snapshot.fill``), made here only for a snapshot sealed without it. It waits
        until the snapshot is sealed: the fan-out starts while ``publish`` is still copying, and a
        copy taken earlier would send (and cache, for every later stream) a half-written model."""
        if snap.device == "cpu":
            return snap
        snap.wait_ready(len(snap.manifest.buckets()) + 1, self.pub.config.weights_timeout)
        with self._host_lock:  # every actor's thread may ask at once
            cached = snap.host
            if cached is None:
                flat = np.ascontiguousarray(snap.flat.cpu().numpy())
                cached = Snapshot(snap.manifest, flat, "cpu", key=snap.key, tags=snap.tags)
                snap.host = cached
        return cached

    def close(self) -> None:
        """End every stream and join its thread (the publisher is closed: none opens again)."""
        with self.pub.cv:
            streams = list(self.by_session.values())
        for stream in streams:
            _shut(stream)
        for stream in streams:
            if stream.thread is not None:
                stream.thread.join(self.pub.config.close_timeout)


def _shut(stream: _Stream) -> None:
    """End a weights stream from any thread: its thread's send or wait returns at once."""
    stream.ended = True
    try:
        stream.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

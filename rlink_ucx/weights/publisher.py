"""The learner's weight fan-out: snapshots, shared-memory maps, and versions streamed to actors.

``publish`` copies the parameters into a flat buffer and returns; the newest version (older
pending ones are skipped: actors only want the newest) then reaches every subscribed actor:

- actors on this host read it from our shared memory (``shared.py``), told where over their
  control connection;
- every other actor holds a *weights stream* of its own: a connection to the learner's port,
  opened by the actor and proven with the session's key over fresh nonces before the learner
  sends or keeps anything on it (``OpenStream``, ``wire/keys.py``). One thread per stream sends
  each version's buckets as soon as they are copied, so the copy of later buckets overlaps the
  sending of earlier ones, and a slow actor delays only itself. An actor on shared memory gets
  one version on such a stream (its first, or one it could not read) and the learner ends it.

Which of these each actor gets for each version is decided in one place, ``route.delivery``.
No port but the learner's own listener is opened for the fan-out, and that listener keeps
nothing for a peer that has not proven the token. Every bucket carries a tag keyed with the
version's secret, which reaches each actor wrapped under its own key. Every step is bounded by
``Config.weights_timeout``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AuthError, Closed, ProtocolError, RLinkError
from ..transport import hostname
from ..transport.session_state import SessionState
from ..transport.sockopts import set_congestion
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire
from .chain import Chain
from .hosts import elect, hosts_report, location_of, note_refusal, note_served, serve_peers, take_over
from .membership import Member, Owner
from .route import Route, delivery
from .snapshot import BufferPool, Snapshot, begin_snapshot, fill, sources, state_dict_of


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


log = logging.getLogger(__name__)

_ON_STREAMS = (Route.STREAM, Route.CATCH_UP)  # a member with an open stream gets the version there
NEWER_GRACE = 1.0  # seconds the fan-out still waits for confirmations once a newer version is published


class Publisher:
    def __init__(self, server: Owner):
        self.server = server
        self.config = server.config
        self.loop = server.loop
        self.latest: Snapshot | None = None  # the newest complete version
        self.pending: Snapshot | None = None  # the newest version, possibly still being copied
        self._pool = BufferPool(shared=self.config.weights_shared_memory)
        self._publish_lock = threading.Lock()  # one snapshot at a time
        self._host_lock = threading.Lock()  # one host copy per CUDA version
        self._cv = threading.Condition()  # guards latest/pending/_fanned/_streams; signals acks and versions
        self._fanned = 0  # newest version whose fan-out has ended
        self._burned = 0  # newest version whose publish failed after its fan-out could start
        self._thread: threading.Thread | None = None
        self._closed = False
        self._streams: dict[int, _Stream] = {}  # session id -> its weights stream
        self._openings: dict[int, _Opening] = {}  # session id -> the stream just proven, until served
        self._chain = Chain(self.config)  # hosts passing versions on to each other
        self.stats: dict[str, Any] = {
            "published": 0, "fanouts": 0, "skipped_versions": 0, "fanout_failures": 0, "shared": 0, "streams": 0,
            "streamed": 0, "streamed_bytes": 0, "bytes_per_version": {}, "from_peers": 0, "relayed": 0, "last_fanout_seconds": None,
            "last_error": None,
        }  # fmt: skip

    # --- training thread ----------------------------------------------------------------------
    def publish(self, obj: Any, *, wait: bool, timeout: float | None) -> int:
        """Snapshot ``obj`` as the next version and start its fan-out. A value that cannot be
        published raises before anything changes (``stats["last_error"]`` says what failed);
        the next good publish fans out at once."""
        with self._publish_lock:
            if self._closed:
                raise Closed("the learner is closed")
            # A version whose copy failed half-way may have reached the fan-out: never reuse its number.
            version = max(self.server.version, self._burned) + 1
            try:
                state = state_dict_of(obj)
                snap = begin_snapshot(state, version, self.config.weights_bucket_bytes, self._pool)
                srcs = sources(snap, state)
            except Exception as exc:
                self.stats["last_error"] = f"publish refused: {exc!r}"[:500]
                raise
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rlink-publisher", daemon=True)
                self._thread.start()
            with self._cv:  # the fan-out starts now and sends each bucket as soon as it is copied
                previous, self.pending = self.pending, snap
                self._cv.notify_all()
            try:
                fill(snap, srcs)
            except BaseException as exc:
                snap.abandon(exc)
                with self._cv:
                    if self.pending is snap:
                        self.pending = previous
                    self._burned = version
                    self.stats["last_error"] = f"publish of version {version} failed: {exc!r}"[:500]
                    self._cv.notify_all()
                raise
            with self._cv:
                self.latest = snap
                self.server.version = version
                self.stats["published"] += 1
                self._cv.notify_all()
        if wait:
            self.wait(version, timeout)
        return version

    def wait(self, version: int, timeout: float | None) -> bool:
        """Until ``version`` (or newer) is fanned out and every live subscriber has it; False
        when ``timeout`` passed first (a slow or frozen actor: it gets the newest version later)."""
        deadline = time.monotonic() + (self.config.weights_timeout if timeout is None else timeout)
        with self._cv:
            while not self._closed:
                if self._fanned >= version and all(s.weights.acked >= version for s in self._subscribers()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.25))
        return False

    def _subscribers(self) -> list[Member]:
        return [s for s in list(self.server.sessions.values()) if s.state is SessionState.OPEN and s.weights.subscribed]

    # --- keys -----------------------------------------------------------------------------------
    def attach_proof(self, session: Member, transport: str) -> bytes:
        """The learner's proof, for the actor, that it attached ``session``'s data plane."""
        return _keys.attach_proof(session.key, session.id, transport)

    def _seal(self, key: bytes, snap: Snapshot) -> tuple[_wire.WeightsKey, _wire.Seal]:
        """The version's secret wrapped for the holder of ``key``, and the Seal binding it."""
        wrapped = self._weights_key(key, snap)
        mac = _keys.seal_mac(key, snap.version, snap.manifest, wrapped.wrapped, snap.tags)
        return wrapped, _wire.Seal(snap.version, list(snap.tags), mac)

    # --- loop thread --------------------------------------------------------------------------
    def on_got(self, session: Member, version: int, where: Any = None) -> None:
        """``session``'s actor has ``version``, verified; ``where``: in a memfd of its own
        (``Got.where``), from which its host's peers may read it (``hosts.py``)."""
        with self._cv:
            member = session.weights
            member.acked = max(member.acked, version)
            note_served(self.server.sessions, session, version)
            latest = self.latest
            if member.streamer and latest is not None:  # it may join the chain now, before the next version
                self._chain.relink(self.server.sessions, latest.manifest.total_bytes, self._send)
            if member.peers and not member.suspect and latest is not None and latest.version == version:
                place = location_of(where, latest.manifest.total_bytes)
                if place is not None:
                    member.held = (version, place)
                    serve_peers(self.server.sessions, session, latest, place, self._tell_peer)
            self._cv.notify_all()

    def on_session_end(self, session: Member) -> None:
        """A session ended: if it was its host's streamer, another actor of the host takes over."""
        with self._cv:
            if not session.weights.streamer:
                return
            session.weights.streamer = False
            self._take_over(elect(self.server.sessions.values(), session.weights.host))

    def on_relay_at(self, session: Member, msg: _wire.RelayAt) -> None:
        with self._cv:
            self._chain.on_relay_at(self.server.sessions, session, msg, self._send)

    def on_relayed(self, session: Member, msg: _wire.Relayed) -> None:
        with self._cv:
            self._chain.on_relayed(session, msg)
            self._cv.notify_all()

    def _take_over(self, successor: Member | None) -> None:
        take_over(self.server.sessions, successor, self.latest, self._tell_peer, self._send)

    def _tell_peer(self, peer: Member, snap: Snapshot, where: list[Any]) -> None:
        """Where ``peer`` reads ``snap``, and its key and Seal under its own key (lock held)."""
        key = peer.weights.key
        assert key is not None  # FROM_PEER: subscribed, so keyed
        wrapped, seal = self._seal(key, snap)
        self._send([peer], _wire.Mapped(snap.manifest, where), wrapped, seal)
        self.stats["from_peers"] += 1

    def on_subscribe(self, session: Member, msg: _wire.Subscribe) -> None:
        if len(msg.nonce) != _auth.NONCE_BYTES:
            raise ProtocolError("weights subscription without a fresh key nonce")
        key = _keys.subscription_key(session.key, msg.nonce)
        # An actor that can open our memfds reads versions from them: on this host only (the
        # name says so; the actor falls back to its weights stream where the memfd still cannot
        # be opened).
        local = session.hello.host == hostname()
        shared = bool(msg.shared) and self._pool.shared and local
        with self._cv:
            member = session.weights
            member.subscribed, member.shared, member.key = True, shared, key
            # Off our host, actors that can read memfds share copies among their host's actors.
            member.host, member.peers = session.hello.host, bool(msg.shared) and not local
            member.relay = member.peers and bool(msg.relay)
            # The actor opens its weights stream for the current version right away (on shared
            # memory: until it acknowledges it, versions are not mapped for it).
            member.sent = self.server.version
            if member.peers:
                elect(self.server.sessions.values(), member.host)
            self._cv.notify_all()

    def verify_stream(self, msg: _wire.OpenStream, nonce: bytes) -> Member:
        """Check a weights stream's opening proof (on the loop, right before :meth:`serve_stream`)."""
        session: Member | None = self.server.sessions.get(msg.session)
        if session is None or session.state is not SessionState.OPEN:
            raise AuthError("weights stream for an unknown session")
        if len(msg.nonce) != _auth.NONCE_BYTES:
            raise AuthError("weights stream without a fresh nonce")
        key = session.key
        _auth.verify(_keys.stream_proof(key, "actor", nonce, msg.nonce, session.id), msg.mac, "weights stream")
        self._openings[session.id] = _Opening(_keys.stream_key(key, nonce, msg.nonce),
                                              _keys.stream_proof(key, "learner", nonce, msg.nonce, session.id))  # fmt: skip
        return session

    async def serve_stream(self, conn: Any, session: Member, have: int) -> None:
        """Answer a proven stream with the learner's proof, then hand the connection to a thread
        of its own (:meth:`_stream_versions`): the newest version newer than ``have`` goes out
        on it (or Version if there is none and the actor reads shared memory), and every later
        version too where :func:`~.route.delivery` routes it by stream."""
        opening = self._openings.pop(session.id, None)  # before any await: verify_stream just set it
        if opening is None:
            raise AuthError("weights stream without a verified proof")
        await self.loop.sock_sendall(conn.sock, _wire.encode(_wire.Proof(opening.proof)))
        conn.handed_off = True  # the stream's thread owns the socket from here on
        sock = conn.sock
        sock.setblocking(True)
        sock.settimeout(self.config.weights_timeout)  # bounds every send (one bucket)
        set_congestion(sock, self.config.tcp_congestion)  # whole models go out on it
        stream = _Stream(session, sock, opening.key, have)
        with self._cv:
            if self._closed:
                sock.close()
                return
            self._take_over(note_refusal(self.server.sessions, session, have))  # a peer's copy failed it?
            self._chain.lost_stream(session)  # or its relay did
            old = self._streams.get(session.id)
            self._streams[session.id] = stream
            self.stats["streams"] = len(self._streams)
        if old is not None:  # a reconnected stream replaces the old one: its thread ends
            _shut(old)
        stream.thread = threading.Thread(target=self._stream_versions, args=(stream,), daemon=True,
                                         name=f"rlink-weights-{session.id}")  # fmt: skip
        stream.thread.start()

    # --- weights stream threads ---------------------------------------------------------------
    def _stream_versions(self, stream: _Stream) -> None:
        try:
            while True:
                snap = self._newer(stream)
                if snap is None:
                    if not self._keeps(stream) and not self._closed:  # a one-version stream, nothing newer
                        stream.sock.sendall(_wire.encode(_wire.Version(self.server.version)))
                    return
                self._push(stream, snap)
                if not self._keeps(stream):
                    return
        except (OSError, RLinkError) as exc:
            if not stream.ended and not self._closed:
                log.info("weights stream of session %d ended: %s", stream.session.id, exc)
        finally:
            _shut(stream)
            stream.sock.close()
            with self._cv:
                if self._streams.get(stream.session.id) is stream:
                    del self._streams[stream.session.id]
                self.stats["streams"] = len(self._streams)

    def _keeps(self, stream: _Stream) -> bool:
        """Whether the stream stays open for later versions (else it carries one): where
        :func:`~.route.delivery` routes the newest version to its actor by stream."""
        s = stream.session
        # Not ``s.weights.subscribed``: only a subscriber opens a stream, and its Subscribe (on
        # the control connection) may be read after its stream opened (on a connection of its
        # own); a stream ended after one version there left the actor to open a second one.
        with self._cv:
            return s.state is SessionState.OPEN and delivery(s.weights, self.pending or self.latest) is Route.STREAM

    def _newer(self, stream: _Stream) -> Snapshot | None:
        """The newest version newer than the stream's (waiting for one while the stream is
        kept), possibly still being copied; None once the stream should end."""
        with self._cv:
            while not (self._closed or stream.ended or stream.session.state is not SessionState.OPEN):
                snap = self.pending if self.pending is not None and self.pending.failed is None else self.latest
                if snap is not None and snap.version > stream.sent:
                    return snap
                if not self._keeps(stream):
                    return None
                self._cv.wait(0.25)
        return None

    def _push(self, stream: _Stream, snap: Snapshot) -> None:
        """Send one version: Publish, its key wrapped for this stream, each bucket as soon
        as it is copied, and the Seal once every bucket is tagged."""
        timeout = self.config.weights_timeout
        source = self._host_copy(snap)  # a CUDA version: once sealed, in host memory
        send = stream.sock.sendall
        send(_wire.encode(_wire.Publish(source.manifest)) + _wire.encode(self._weights_key(stream.key, source)))
        for i, (a, b) in enumerate(source.manifest.buckets()):
            source.wait_ready(i + 1, timeout)
            send(memoryview(source.flat[a:b]))
        source.wait_ready(len(source.manifest.buckets()) + 1, timeout)
        send(_wire.encode(self._seal(stream.key, source)[1]))
        stream.sent = source.version
        with self._cv:
            member = stream.session.weights
            member.sent = max(member.sent, source.version)
            self.stats["streamed"] += 1
            self.stats["streamed_bytes"] += source.manifest.total_bytes
            sent = self.stats["bytes_per_version"]  # the learner's own sends, newest versions only
            sent[source.version] = sent.get(source.version, 0) + source.manifest.total_bytes
            for old in [v for v in sent if v <= source.version - 4]:
                del sent[old]

    # --- fan-out thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self.pending is None or self.pending.version <= self._fanned):
                    self._cv.wait()
                if self._closed:
                    break
                snap = self.pending
                assert snap is not None
                self.stats["skipped_versions"] += max(0, snap.version - self._fanned - 1)
            started = time.monotonic()
            try:
                self._fan_out(snap)
            except Exception as exc:  # the fan-out thread must outlive any one failure
                log.exception("fan-out of version %d failed", snap.version)
                self.stats["last_error"] = repr(exc)
            with self._cv:
                self._fanned = snap.version
                self.stats["fanouts"] += 1
                self.stats["last_fanout_seconds"] = round(time.monotonic() - started, 6)
                self._cv.notify_all()

    def _fan_out(self, snap: Snapshot) -> None:
        timeout = self.config.weights_timeout
        sessions = [s for s in list(self.server.sessions.values()) if s.state is SessionState.OPEN]
        with self._cv:
            subscribed = [s for s in sessions if s.weights.subscribed]
            for host in {s.weights.host for s in subscribed if s.weights.peers}:
                elect(sessions, host)  # a streamer whose end was not reported yet is replaced
            self._chain.relink(self.server.sessions, snap.manifest.total_bytes, self._send)
            routes = {s.id: delivery(s.weights, snap) for s in subscribed}
            # Those routed to our shared memory read the version there; those with a weights
            # stream get it on the stream, from its own thread; those reading a peer's copy are
            # told where once their host's streamer confirms it (``on_got``).
            sharing = [s for s in subscribed if routes[s.id] is Route.SHARED]
            from_peers = {s.id for s in subscribed if routes[s.id] is Route.FROM_PEER}
            relayed = [s for s in subscribed if routes[s.id] is Route.RELAY]
            streaming = [s for s in subscribed if s.id in self._streams and routes[s.id] in _ON_STREAMS]
            for s in sharing + relayed:
                s.weights.sent = snap.version
            for s in relayed:  # whose copy it reads: a refusal strikes that relay (hosts.note_refusal)
                s.weights.mapped_from = s.weights.relay_from
            keys = {s.id: key for s in sharing + relayed if (key := s.weights.key) is not None}  # subscribed: set
        others = [s for s in sessions if s not in sharing and s not in streaming and s.id not in from_peers
                  and s not in relayed]  # fmt: skip
        if sharing:  # every bucket copied: they read while the tags are computed
            snap.wait_ready(len(snap.manifest.buckets()), timeout)
            self._map(sharing, snap, keys)
        snap.wait_ready(len(snap.manifest.buckets()) + 1, timeout)
        for s in sharing:  # once every tag is computed
            self._send([s], self._seal(keys[s.id], snap)[1])
        for s in relayed:  # its bytes come through the chain, its key and Seal from us
            self._send([s], _wire.Version(snap.version), *self._seal(keys[s.id], snap))
        self.stats["shared"] += len(sharing)
        self.stats["relayed"] += len(relayed)
        # Once complete: the others open a weights stream for it; those with one have it on its
        # way there (so ``get_remote_model(latest=True)`` knows of it, and one whose stream
        # broke, or that refused what came on it, opens a new one).
        self._send(others + streaming, _wire.Version(snap.version))
        self._await_confirmations(snap, sharing + streaming + relayed)

    def _await_confirmations(self, snap: Snapshot, members: list[Member]) -> None:
        """Wait (bounded) until ``members`` verified ``snap``: an actor on shared memory that does
        not confirm it catches up by stream with the next version. The wait paces the fan-out to
        its actors (a learner publishing faster than they read skips versions). Once a newer
        version is published it lasts at most :data:`NEWER_GRACE` more: one frozen actor must not
        hold every other actor's next version back for ``weights_timeout`` (a SIGSTOPped
        on-policy actor did, for 30 s per version)."""
        deadline = time.monotonic() + self.config.weights_timeout
        with self._cv:
            while any(s.state is SessionState.OPEN and s.weights.acked < snap.version for s in members):
                if self._closed:
                    return
                now = time.monotonic()
                if self.pending is not None and self.pending.version > snap.version:
                    if deadline > now + NEWER_GRACE:
                        deadline = now + NEWER_GRACE
                    elif deadline <= now:
                        return  # the next version goes out; the laggards catch up by stream
                elif deadline <= now:
                    self.stats["fanout_failures"] += 1
                    self.stats["last_error"] = f"version {snap.version}: not every actor confirmed it in time"
                    return
                self._cv.wait(min(deadline - now, 0.25))

    def _weights_key(self, key: bytes, snap: Snapshot) -> _wire.WeightsKey:
        """The version's secret wrapped for the holder of ``key``."""
        return _wire.WeightsKey(snap.version, _keys.wrap(key, snap.version, snap.key.secret))

    def _map(self, sharing: list[Member], snap: Snapshot, keys: dict[int, bytes]) -> None:
        """Tell actors on this host where the version lies in our shared memory (its Seal follows)."""
        where = snap.shared
        if where is None:  # never: ``sharing`` only holds actors when the snapshot is in shared memory
            return
        for s in sharing:
            self._send([s], _wire.Mapped(snap.manifest, where), self._weights_key(keys[s.id], snap))

    def _send(self, sessions: list[Member], *msgs: Any) -> None:
        for s in sessions:
            for msg in msgs:
                try:
                    self.loop.call_soon_threadsafe(s.control.send, msg)
                except RuntimeError:  # the loop has stopped: the learner is closing
                    return

    def _host_copy(self, snap: Snapshot) -> Snapshot:
        """A host copy of a CUDA snapshot, for the weights streams: the one its tags were
        computed on (``snapshot.fill``), made here only for a snapshot sealed without it. It waits
        until the snapshot is sealed: the fan-out starts while ``publish`` is still copying, and a
        copy taken earlier would send (and cache, for every later stream) a half-written model."""
        if snap.device == "cpu":
            return snap
        snap.wait_ready(len(snap.manifest.buckets()) + 1, self.config.weights_timeout)
        with self._host_lock:  # every actor's thread may ask at once
            cached = snap.host
            if cached is None:
                flat = np.ascontiguousarray(snap.flat.cpu().numpy())
                cached = Snapshot(snap.manifest, flat, "cpu", key=snap.key, tags=snap.tags)
                snap.host = cached
        return cached

    # --- reporting and shutdown ------------------------------------------------------------------
    def snapshot_stats(self) -> dict[str, Any]:
        return {
            **self.stats,
            "version": self.server.version,
            "fanned_out": self._fanned,
            "model_bytes": self.latest.manifest.total_bytes if self.latest else 0,
            "bytes_per_version": dict(self.stats["bytes_per_version"]),
            "hosts": hosts_report(list(self.server.sessions.values()), self.server.version),
            "relay": self._chain.report(self.server.sessions),
        }

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            streams = list(self._streams.values())
        for stream in streams:
            _shut(stream)
        if self._thread is not None:
            self._thread.join(self.config.close_timeout)
        for stream in streams:
            if stream.thread is not None:
                stream.thread.join(self.config.close_timeout)


def _shut(stream: _Stream) -> None:
    """End a weights stream from any thread: its thread's send or wait returns at once."""
    stream.ended = True
    try:
        stream.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

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
import threading
import time
from typing import Any

from ..errors import Closed, ProtocolError
from ..transport import hostname
from ..transport.session_state import SessionState
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire
from .broadcast import Caster, backend_of
from .chain import Chain
from .hosts import elect, hosts_report, location_of, note_refusal, note_served, serve_peers, take_over
from .membership import Member, Owner
from .route import Route, delivery
from .snapshot import BufferPool, Snapshot, begin_snapshot, fill, sources, state_dict_of
from .streams import Streams

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
        self.cv = threading.Condition()  # guards latest/pending/_fanned/streams; signals acks and versions
        self._fanned = 0  # newest version whose fan-out has ended
        self._burned = 0  # newest version whose publish failed after its fan-out could start
        self._thread: threading.Thread | None = None
        self.closed = False
        self._ending = False  # the learner is closing: its sessions end, nobody takes over
        self.streams = Streams(self)  # the actors' weights streams
        self._chain = Chain(self.config)  # hosts passing versions on to each other
        self._cast = Caster(self)  # or, on a trusted network, a broadcast group of them
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
            if self.closed:
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
            with self.cv:  # the fan-out starts now and sends each bucket as soon as it is copied
                previous, self.pending = self.pending, snap
                self.cv.notify_all()
            try:
                fill(snap, srcs)
            except BaseException as exc:
                snap.abandon(exc)
                with self.cv:
                    if self.pending is snap:
                        self.pending = previous
                    self._burned = version
                    self.stats["last_error"] = f"publish of version {version} failed: {exc!r}"[:500]
                    self.cv.notify_all()
                raise
            with self.cv:
                self.latest = snap
                self.server.version = version
                self.stats["published"] += 1
                self.cv.notify_all()
        if wait:
            self.wait(version, timeout)
        return version

    def wait(self, version: int, timeout: float | None) -> bool:
        """Until ``version`` (or newer) is fanned out and every live subscriber has it; False
        when ``timeout`` passed first (a slow or frozen actor: it gets the newest version later)."""
        deadline = time.monotonic() + (self.config.weights_timeout if timeout is None else timeout)
        with self.cv:
            while not self.closed:
                if self._fanned >= version and all(s.weights.acked >= version for s in self._subscribers()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(min(left, 0.25))
        return False

    def _subscribers(self) -> list[Member]:
        return [s for s in list(self.server.sessions.values()) if s.state is SessionState.OPEN and s.weights.subscribed]

    # --- keys -----------------------------------------------------------------------------------
    def attach_proof(self, session: Member, transport: str) -> bytes:
        """The learner's proof, for the actor, that it attached ``session``'s data plane."""
        return _keys.attach_proof(session.key, session.id, transport)

    def seal(self, key: bytes, snap: Snapshot) -> tuple[_wire.WeightsKey, _wire.Seal]:
        """The version's secret wrapped for the holder of ``key``, and the Seal binding it."""
        wrapped = self.weights_key(key, snap)
        mac = _keys.seal_mac(key, snap.version, snap.manifest, wrapped.wrapped, snap.tags)
        return wrapped, _wire.Seal(snap.version, list(snap.tags), mac)

    # --- loop thread --------------------------------------------------------------------------
    def on_got(self, session: Member, version: int, where: Any = None) -> None:
        """``session``'s actor has ``version``, verified; ``where``: in a memfd of its own
        (``Got.where``), from which its host's peers may read it (``hosts.py``)."""
        with self.cv:
            member = session.weights
            member.acked = max(member.acked, version)
            note_served(self.server.sessions, session, version)
            self._chain.served(self.server.sessions, session, version)
            latest = self.latest
            if member.streamer and latest is not None:  # it may join the chain now, before the next version
                self._relink(latest.manifest.total_bytes)
                self._cast.plan(self.server.sessions, backend_of(latest))
            newest = self._newest()
            if member.peers and not member.suspect and newest is not None and newest.version == version and newest.sealed:
                place = location_of(where, newest.manifest.total_bytes)
                if place is not None:
                    member.held = (version, place)
                    serve_peers(self.server.sessions, session, newest, place, self._tell_peer)
            self.cv.notify_all()

    def on_session_end(self, session: Member) -> None:
        """A session ended: if it was its host's streamer, another actor of the host takes over."""
        with self.cv:
            if not session.weights.streamer or self._ending:
                return
            session.weights.streamer = False
            self._take_over(elect(self.server.sessions.values(), session.weights.host))

    def verify_stream(self, msg: _wire.OpenStream, nonce: bytes) -> Member:
        """Check a weights stream's opening proof (``streams.Streams.verify``)."""
        return self.streams.verify(msg, nonce)

    async def serve_stream(self, conn: Any, session: Member, have: int) -> None:
        """Make a proven connection ``session``'s weights stream (``streams.Streams.serve``)."""
        await self.streams.serve(conn, session, have)

    def stream_opened(self, session: Member, have: int) -> None:
        """``session`` opened a weights stream for versions above ``have`` (lock held): if it
        was to read a peer's copy or take versions from a relay, that source failed it."""
        self._take_over(note_refusal(self.server.sessions, session, have))
        self._chain.lost_stream(session)  # a relay's reader says what it refused in Relayed

    def on_relay_at(self, session: Member, msg: _wire.RelayAt) -> None:
        with self.cv:
            self._chain.on_relay_at(self.server.sessions, session, msg, self._send)

    def on_relayed(self, session: Member, msg: _wire.Relayed) -> None:
        with self.cv:
            self._chain.on_relayed(session, msg)
            self.cv.notify_all()

    def on_broadcast_joined(self, session: Member, msg: _wire.BroadcastJoined) -> None:
        with self.cv:
            self._cast.on_joined(session, msg)

    def _relink(self, model_bytes: int) -> None:
        for successor in self._chain.relink(self.server.sessions, model_bytes, self._send):
            self._take_over(successor)

    def _take_over(self, successor: Member | None) -> None:
        take_over(self.server.sessions, successor, self._newest(), self._tell_peer, self._send)

    def _newest(self) -> Snapshot | None:
        """The newest version published: ``pending`` (sealed, or still being copied) unless its
        copy failed, else ``latest``. Not ``latest`` alone: ``publish`` sets it only once the
        snapshot is sealed, and its Seal goes out at once (``_fan_out``, the streams), so on a
        loaded machine an actor's Got can come first. Judged against ``latest``, that Got
        served its host's peers nothing, and a streamer elected meanwhile was told of the
        version before: they waited for the next version (a ``publish`` unconfirmed for 60 s)."""
        pending = self.pending
        return pending if pending is not None and pending.failed is None else self.latest

    def _tell_peer(self, peer: Member, snap: Snapshot, where: list[Any]) -> None:
        """Where ``peer`` reads ``snap``, and its key and Seal under its own key (lock held)."""
        key = peer.weights.key
        assert key is not None  # FROM_PEER: subscribed, so keyed
        wrapped, seal = self.seal(key, snap)
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
        with self.cv:
            member = session.weights
            member.subscribed, member.shared, member.key = True, shared, key
            # Off our host, actors that can read memfds share copies among their host's actors.
            member.host, member.peers = session.hello.host, bool(msg.shared) and not local
            member.relay = member.peers and bool(msg.relay)
            member.cast = member.peers and bool(msg.broadcast)  # joins the broadcast group when asked
            # The actor opens its weights stream for the current version right away (on shared
            # memory: until it acknowledges it, versions are not mapped for it).
            member.sent = self.server.version
            if member.peers:
                elect(self.server.sessions.values(), member.host)
            self.cv.notify_all()

    # --- fan-out thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.closed and (self.pending is None or self.pending.version <= self._fanned):
                    self.cv.wait()
                if self.closed:
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
            with self.cv:
                self._fanned = snap.version
                self.stats["fanouts"] += 1
                self.stats["last_fanout_seconds"] = round(time.monotonic() - started, 6)
                self.cv.notify_all()

    def _fan_out(self, snap: Snapshot) -> None:
        timeout = self.config.weights_timeout
        sessions = [s for s in list(self.server.sessions.values()) if s.state is SessionState.OPEN]
        with self.cv:
            subscribed = [s for s in sessions if s.weights.subscribed]
            for host in {s.weights.host for s in subscribed if s.weights.peers}:
                elect(sessions, host)  # a streamer whose end was not reported yet is replaced
            self._relink(snap.manifest.total_bytes)
            self._cast.plan(self.server.sessions, backend_of(snap))
            routes = {s.id: delivery(s.weights, snap) for s in subscribed}
            # Those routed to our shared memory read the version there; those with a weights
            # stream get it on the stream, from its own thread; those reading a peer's copy are
            # told where once their host's streamer confirms it (``on_got``).
            sharing = [s for s in subscribed if routes[s.id] is Route.SHARED]
            from_peers = {s.id for s in subscribed if routes[s.id] is Route.FROM_PEER}
            relayed = [s for s in subscribed if routes[s.id] is Route.RELAY]
            cast = [s for s in subscribed if routes[s.id] is Route.BROADCAST]  # bytes by broadcast (broadcast.py)
            self._cast.submit(snap, cast)
            streaming = [s for s in subscribed if s.id in self.streams.by_session and routes[s.id] in _ON_STREAMS]
            # Routed by stream but with none open: told of the version below, and sent it from
            # then on, so a host's streamer stopped before it opened its stream is behind too
            # (the chain's stall rule splices it out; noted only by a stream's push, it never was).
            announced = [s for s in subscribed if routes[s.id] is Route.STREAM and s.id not in self.streams.by_session]
            for s in sharing + relayed + cast + announced:
                s.weights.sent = snap.version
            for s in relayed:  # whose copy it reads: a refusal strikes that relay (chain.py)
                s.weights.relay_read = s.weights.relay_from
            keys = {s.id: key for s in sharing + relayed + cast if (key := s.weights.key) is not None}  # subscribed: set
        others = [s for s in sessions if s not in sharing and s not in streaming and s.id not in from_peers
                  and s not in relayed and s not in cast]  # fmt: skip
        if sharing:  # every bucket copied: they read while the tags are computed
            snap.wait_ready(len(snap.manifest.buckets()), timeout)
            self._map(sharing, snap, keys)
        snap.wait_ready(len(snap.manifest.buckets()) + 1, timeout)
        for s in sharing:  # once every tag is computed
            self._send([s], self.seal(keys[s.id], snap)[1])
        for s in relayed:  # its bytes come through the chain, its key and Seal from us
            self._send([s], _wire.Version(snap.version), *self.seal(keys[s.id], snap))
        for s in cast:  # its Broadcast comes from the broadcast thread, before the bytes
            self._send([s], *self.seal(keys[s.id], snap))
        self.stats["shared"] += len(sharing)
        self.stats["relayed"] += len(relayed)
        # Once complete: the others open a weights stream for it; those with one have it on its
        # way there (so ``get_remote_model(latest=True)`` knows of it, and one whose stream
        # broke, or that refused what came on it, opens a new one).
        self._send(others + streaming, _wire.Version(snap.version))
        self._await_confirmations(snap, sharing + streaming + relayed + cast)

    def _await_confirmations(self, snap: Snapshot, members: list[Member]) -> None:
        """Wait (bounded) until ``members`` verified ``snap``: an actor on shared memory that does
        not confirm it catches up by stream with the next version. The wait paces the fan-out to
        its actors (a learner publishing faster than they read skips versions). Once a newer
        version is published it lasts at most :data:`NEWER_GRACE` more: one frozen actor must not
        hold every other actor's next version back for ``weights_timeout`` (a SIGSTOPped
        on-policy actor did, for 30 s per version)."""
        deadline = time.monotonic() + self.config.weights_timeout
        with self.cv:
            while any(s.state is SessionState.OPEN and s.weights.acked < snap.version for s in members):
                if self.closed:
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
                self.cv.wait(min(deadline - now, 0.25))

    def weights_key(self, key: bytes, snap: Snapshot) -> _wire.WeightsKey:
        """The version's secret wrapped for the holder of ``key``."""
        return _wire.WeightsKey(snap.version, _keys.wrap(key, snap.version, snap.key.secret))

    def _map(self, sharing: list[Member], snap: Snapshot, keys: dict[int, bytes]) -> None:
        """Tell actors on this host where the version lies in our shared memory (its Seal follows)."""
        where = snap.shared
        if where is None:  # never: ``sharing`` only holds actors when the snapshot is in shared memory
            return
        for s in sharing:
            self._send([s], _wire.Mapped(snap.manifest, where), self.weights_key(keys[s.id], snap))

    def _send(self, sessions: list[Member], *msgs: Any) -> None:
        for s in sessions:
            for msg in msgs:
                try:
                    self.loop.call_soon_threadsafe(s.control.send, msg)
                except RuntimeError:  # the loop has stopped: the learner is closing
                    return

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
            "broadcast": self._cast.report(),
        }

    def closing(self) -> None:
        """The learner ends every session now: no host's actor takes its streamer's place."""
        with self.cv:
            self._ending = True

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.streams.close()
        self._cast.close()
        if self._thread is not None:
            self._thread.join(self.config.close_timeout)

"""The actor's side of the weight fan-out: keeps the newest version ready, double-buffered.

A background thread receives each version into a buffer nobody else is reading: from the
learner's shared memory when it shares the learner's host, else over a *weights stream* of its
own (a connection to the learner's port), on which both sides prove the session's weights key
over fresh nonces before anything else is read, or, where the learner links its hosts into a
chain, from the actor of the host before it (``relay.py``). The learner sends each later version
on that stream as it copies it; the thread tags each bucket as it arrives, and passes each piece
on to the actors that relay from it. Only a complete version whose every bucket matched its
keyed tag, under a Seal this actor's key verifies, is exposed: ``get_remote_model`` never sees a
half-written or altered one, and costs no network round trip when nothing changed. The actor
listens nowhere until the learner asks it to relay.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import AuthError, Closed, ProtocolError, RLinkError
from ..transport.loop import IOThread
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire
from ..wire.frameworks import Adapter
from .cast_member import CastLink
from .inbox import Inbox
from .mac import VersionKey, check_tags
from .relay import RelayServer, dial, receive, stall_timeout
from .shared import available as shared_available
from .shared import holder_gone, read_into
from .snapshot import BufferPool, Snapshot
from .stream_link import (
    Connection,
    Link,
    Unproven,
    open_seal,
    open_stream,
    read_reply,
    readable,
    tag_completed,
    timed_out,
)

log = logging.getLogger(__name__)


_OPEN = object()  # event: open a weights stream now, whatever the announced version


class _RelayFailed(RLinkError):
    """Our relay broke, stalled, or passed on a copy we refused (``refused``: its version):
    take the version by stream."""

    def __init__(self, text: str, refused: int = 0):
        super().__init__(text)
        self.refused = refused


class Subscriber:
    def __init__(self, conn: Link, io: IOThread, config: Config):
        self.conn = conn
        self.io = io
        self.config = config
        self.ready: Snapshot | None = None
        self._tensors: dict[str, dict[str, Any]] = {}  # views of ``ready`` by format, made on first use
        # Versions are kept in sealed memfds where the host has them: off the learner's host,
        # the learner may have this host's other actors read them from here (``hosts.py``).
        self._pool = BufferPool(shared=config.weights_shared_memory)
        self._inbox = Inbox()
        self._cv = threading.Condition()
        self._closed = False
        self._stream: Connection | None = None  # our weights stream, once opened
        self._relay_in: Connection | None = None  # the relay we take versions from, once linked
        self._relay: RelayServer | None = None  # our listener, once the learner asked us to relay
        self._quiet_since: float | None = None  # since when a newer version is due from our relay
        self._tagger: concurrent.futures.ThreadPoolExecutor | None = None  # tags buckets while the next arrive
        self.rejected: RLinkError | None = None  # the last version refused as altered or unproven
        self._cast = CastLink(config, conn, lambda msg: io.soon(self._send, msg))  # broadcast.py's group
        self.stats: dict[str, Any] = {"connections": 0, "shared_reads": 0, "streamed": 0, "relayed": 0, "broadcast": 0,
                                      "relay_failures": 0, "failures": 0, "rejected": 0,
                                      "last_error": None}  # fmt: skip
        conn.weights_listener = self.deliver
        self._nonce = _auth.new_nonce()  # makes this subscription's key fresh (wire/keys.py)
        self._unreadable = 0  # shared reads that failed in a row: at two, stop asking for them
        self._thread = threading.Thread(target=self._run, name="rlink-weights", daemon=True)
        self._thread.start()
        shared = config.weights_shared_memory and shared_available()  # the learner decides if we share its host
        cast = shared and config.weights_fanout == "broadcast" and importlib.util.find_spec("torch") is not None
        conn.subscription = _wire.Subscribe(self._nonce, shared, config.weights_relay, cast)  # repeated after a reconnect
        io.soon(self._send, conn.subscription)
        self._inbox.put(_OPEN)

    @property
    def have(self) -> int:
        return self.ready.version if self.ready is not None else 0

    # --- I/O loop: control messages from the learner ----------------------------------------
    def deliver(self, msg: Any) -> None:
        with self._cv:
            self._cv.notify_all()  # conn.latest_version moved: waiters re-check
        self._inbox.put(msg)

    def _send(self, msg: Any) -> None:
        if self.conn.control is not None:
            self.conn.control.send(msg)

    # --- caller's thread ----------------------------------------------------------------------
    def get(self, deadline: float, latest: bool, newer_than: int | None = None) -> Snapshot | None:
        """The newest complete version (:meth:`arrays` hands it out), waiting for it until
        ``deadline`` (``time.monotonic()``). ``latest``: at least the version the
        learner had announced when the call began. Not a newer one announced meanwhile: with a
        learner publishing faster than this actor takes versions in, chasing each announcement
        could keep the caller waiting until its timeout. ``newer_than``: a version above it.
        None: ``latest`` is False, no ``newer_than``, and no version is here yet (no wait).

        The connection's end is checked first, on every call: an actor that only reads weights
        learns that its learner closed (:class:`Closed`) or was lost past
        ``Config.reconnect_timeout`` (:class:`PeerLost`) from this call. Except for a version
        above ``newer_than`` that arrived before the end: the learner's last publish (which its
        ``publish(wait=True)`` saw delivered) is still handed out, and the next call raises."""
        with self._cv:
            wanted = self.conn.latest_version if latest else 0
            if newer_than is not None:
                wanted = max(wanted, newer_than + 1)
            elif not latest and self.ready is None:
                self._raise_if_ended()
                return None
            while True:
                ready = self.ready
                here = ready is not None and ready.version >= wanted
                if not (here and newer_than is not None):
                    self._raise_if_ended()
                if here:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise timed_out(self.conn.latest_version, self.have, self.rejected, newer_than) from self.rejected
                self._cv.wait(min(left, 0.25))
            return ready

    def arrays(self, snap: Snapshot, adapter: Adapter) -> dict[str, Any]:
        """``snap``'s arrays, flat (name -> array of ``adapter``'s framework); made once per
        format for the version that is ready."""
        with self._cv:
            if snap is not self.ready:
                return snap.arrays(adapter)
            arrays = self._tensors.get(adapter.format)
            if arrays is None:
                arrays = self._tensors[adapter.format] = snap.arrays(adapter)
            return dict(arrays)

    def _raise_if_ended(self) -> None:
        if self._closed:
            raise Closed("the actor is closed")
        error = self.conn.error
        if error is not None:
            raise type(error)(str(error)) from error

    # --- weights thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            try:
                self._step()
            except _RelayFailed as exc:  # the learner has the version: take it from there now
                self._lose_relay(tell=True, refused=exc.refused)
                self._note_failure("relay_failures", exc)
                self._inbox.put(_OPEN)
            except Exception as exc:  # noqa: BLE001 - logged and counted; the next version retries
                self._drop_stream()
                self._note_failure("failures", exc)
                if not self._closed and self.conn.latest_version > self.have:
                    time.sleep(min(1.0, self.config.heartbeat_interval))  # do not spin on a broken learner
                    self._inbox.put(_OPEN)
        self._drop_stream()
        self._lose_relay(tell=False)
        self._cast.leave()
        if self._relay is not None:
            self._relay.close()

    def _step(self) -> None:
        """Read what arrived on our stream or from our relay, then one control message."""
        self._watch_relay()
        stream, relay = self._stream, self._relay_in
        socks = [c.sock for c in (stream, relay) if c is not None]
        for sock in readable(socks, 0.25) if socks else ():
            if stream is not None and sock is stream.sock:
                self._take(stream)
            elif relay is not None and sock is relay.sock:
                self._take_relayed(relay)
        msg = self._inbox.get(0.0 if socks else 0.25)
        if msg is _OPEN or (isinstance(msg, _wire.Version) and msg.version > self.have):
            if self._stream is None and self._relay_in is None:  # either brings every version by itself
                self._open()
        elif isinstance(msg, _wire.Mapped):
            self._read_shared(msg)
        elif isinstance(msg, _wire.RelayServe):
            self._serve_relay(msg)
        elif isinstance(msg, _wire.RelayFrom):
            self._relay_from(msg)
        elif isinstance(msg, _wire.BroadcastJoin):
            self._cast.join(msg)
            if not self._cast.active and self._stream is None and self.conn.latest_version > self.have:
                self._inbox.put(_OPEN)  # left the group: the learner sends versions by stream again
        elif isinstance(msg, _wire.Broadcast):
            self._take_cast(msg)

    def _note_failure(self, counter: str, exc: Exception) -> None:
        self.stats[counter] += 1
        self.stats["last_error"] = repr(exc)[:500]
        if not self._closed:
            log.warning("actor %s: weights update failed: %s", self.conn.actor_id, exc)

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.sock.close()

    # --- relays (relay.py) --------------------------------------------------------------------
    def _serve_relay(self, msg: _wire.RelayServe) -> None:
        """The learner asks us to pass versions on to an actor proving ``msg.link``'s key."""
        port = 0
        control = self.conn.control
        if self.config.weights_relay and control is not None and len(msg.link) == _auth.NONCE_BYTES:
            try:
                if self._relay is None:  # on the address our control connection comes from
                    self._relay = RelayServer(control.sock.getsockname()[0], self.config)
                port = self._relay.serve(msg.link, _keys.relay_key(self.conn.weights_key(), msg.link))
            except OSError as exc:
                log.warning("actor %s: cannot listen for relay readers: %s", self.conn.actor_id, exc)
        self.io.soon(self._send, _wire.RelayAt(msg.link, port))

    def _relay_from(self, msg: _wire.RelayFrom) -> None:
        """Take versions from the relay the learner names (port 0: from the learner again)."""
        self._lose_relay(tell=False)
        if msg.port == 0:
            if self.conn.latest_version > self.have:
                self._inbox.put(_OPEN)
            return
        key = _keys.wrap_relay_key(self._subscription_key(), msg.link, msg.wrapped)
        try:
            sock = dial(msg.host, msg.port, msg.link, key, self.have, self.config)
        except (OSError, RLinkError) as exc:
            self._note_failure("relay_failures", exc)
            self.io.soon(self._send, _wire.Relayed(msg.session, False))
            return
        self._relay_in = Connection(sock, key, msg.session)
        self.io.soon(self._send, _wire.Relayed(msg.session, True))

    def _lose_relay(self, *, tell: bool, refused: int = 0) -> None:
        relay, self._relay_in = self._relay_in, None
        self._quiet_since = None
        if relay is not None:
            relay.sock.close()
            if tell:  # the learner relinks around it; we take versions by stream meanwhile
                self.io.soon(self._send, _wire.Relayed(relay.session, False, refused))

    def _watch_relay(self) -> None:
        """A relay that sends nothing while a newer version is due is given up on."""
        if self._relay_in is None or self.conn.latest_version <= self.have:
            self._quiet_since = None
            return
        now = time.monotonic()
        if self._quiet_since is None:
            self._quiet_since = now
        elif now - self._quiet_since > stall_timeout(self.config):
            raise _RelayFailed(f"the relay sent nothing of version {self.conn.latest_version} in time")

    def _take_relayed(self, relay: Connection) -> None:
        """Read one version our relay passes on (passing it on in turn), then check it under
        the key and Seal the learner sent us for it."""
        sock = relay.sock
        try:
            if not sock.recv(1, socket.MSG_PEEK):
                raise _RelayFailed("the relay closed the connection")
            manifest = self._read(sock, _wire.Publish).manifest
            self._check(manifest)
            self._quiet_since = None
            flat, where = self._receive(sock, manifest)
        except (OSError, EOFError, ProtocolError) as exc:
            raise _RelayFailed(f"relay connection: {exc!r}") from exc
        version = manifest.version
        try:
            self._check_elsewhere("relayed", manifest, flat, where)
        except RLinkError as exc:  # refused, or not ours to check: the learner sends it itself
            refused = version if exc is self.rejected else 0
            raise _RelayFailed(f"version {version} from the relay: {exc}", refused) from exc

    def _take_cast(self, msg: _wire.Broadcast) -> None:
        """Take one version by broadcast in the learner's group (``cast_member.py``), then check
        it under the key and Seal the learner sent us for it; refused: by stream."""
        got = self._cast.take(msg, self._pool)
        if got is not None:
            try:
                self._check_elsewhere("broadcast", msg.manifest, *got)
            except RLinkError:
                self._inbox.put(_OPEN)  # this version by stream; later ones by broadcast still
                raise

    def _check_elsewhere(self, path: str, manifest: Any, flat: Any, where: list[Any] | None) -> None:
        """Expose a version whose bytes came from elsewhere than the learner once every bucket
        matches its tag under the key and Seal from our control connection (``path``: counted
        under it)."""
        version = manifest.version
        if version <= self.have:
            return
        subscription_key = self._subscription_key()
        wrapped = self._inbox.wait_for(_wire.WeightsKey, version, stall_timeout(self.config))
        key = VersionKey(_keys.wrap(subscription_key, version, wrapped.wrapped))
        tags = [key.tag(flat, a, b, version, i) for i, (a, b) in enumerate(manifest.buckets())]
        snap = Snapshot(manifest, flat, "cpu", key=key, tags=tags)
        snap.shared = where
        self._seal_and_expose(path, snap, subscription_key, wrapped, stall_timeout(self.config))

    def _receive(self, sock: socket.socket, manifest: Any, on_piece: Callable[[Any, int], None] | None = None
                 ) -> tuple[Any, list[Any] | None]:  # fmt: skip
        """Read ``manifest``'s bytes into a fresh buffer, passing each piece on to our relay's
        readers as it is in (``relay.receive``); the buffer and where it lies."""
        return receive(sock, manifest, self._pool, self._relay, on_piece)

    def _subscription_key(self) -> bytes:
        return _keys.subscription_key(self.conn.weights_key(), self._nonce)

    def _expose(self, snap: Snapshot) -> None:
        with self._cv:
            if self.ready is None or snap.version > self.ready.version:
                self.ready, self._tensors = snap, {}
                self.rejected = None
            self._cv.notify_all()
        self.io.soon(self._send, _wire.Got(snap.version, snap.shared))

    def _check(self, manifest: Any) -> None:
        manifest.validate(max_bytes=self.config.max_weights_bytes, max_entries=self.config.max_weights_tensors)

    def _refuse(self, exc: RLinkError) -> RLinkError:
        """Note a version refused as unproven or altered (``get`` reports it); returns ``exc``."""
        self.rejected = exc
        self.stats["rejected"] += 1
        return exc

    def _verify(self, key: bytes, snap: Snapshot, wrapped: _wire.WeightsKey, seal: _wire.Seal) -> None:
        """Refuse ``snap`` (``rejected``) unless its Seal verifies under ``key`` and every tag matches."""
        try:
            open_seal(key, snap.manifest, wrapped, seal)  # a ProtocolError: not this version's Seal
        except AuthError as exc:
            raise self._refuse(exc) from None
        try:
            check_tags(list(seal.tags), snap.tags, snap.version)
        except ProtocolError as exc:
            raise self._refuse(exc) from None

    def _open(self) -> None:
        try:
            self._stream = open_stream(self.conn, self.have, self.config)
        except Unproven as exc:  # reported to the caller as what it is: an AuthError
            raise self._refuse(AuthError(str(exc))) from None
        self.stats["connections"] += 1

    def _take(self, stream: Connection) -> None:
        """Read what the learner sent on our weights stream: one version (tagging each
        bucket as it arrives), or Version (nothing newer), or its end."""
        sock = stream.sock
        try:
            if not sock.recv(1, socket.MSG_PEEK):  # the learner closed it between versions
                self._drop_stream()
                if self.conn.latest_version > self.have and self._relay_in is None and not self._cast.active:
                    self._inbox.put(_OPEN)
                return
        except OSError:
            self._drop_stream()
            raise
        reply = self._read(sock, (_wire.Version, _wire.Publish))
        if isinstance(reply, _wire.Version):
            return  # nothing newer than what we have
        manifest = reply.manifest
        self._check(manifest)
        version = manifest.version
        wrapped = self._read(sock, _wire.WeightsKey)
        if wrapped.version != version:
            raise ProtocolError(f"weights key for version {wrapped.version}, expected {version}")
        key = VersionKey(_keys.wrap(stream.key, version, wrapped.wrapped))  # trusted once the Seal verifies
        if self._tagger is None:
            self._tagger = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlink-weights-tags")
        tagger, buckets = self._tagger, manifest.buckets()
        tags: list[concurrent.futures.Future[bytes]] = []

        def tag_arrived(flat: Any, done: int) -> None:  # tag each bucket while the next arrive
            tag_completed(buckets, tags, done, lambda i, a, b: tagger.submit(key.tag, flat, a, b, version, i))

        flat, where = self._receive(sock, manifest, tag_arrived)
        seal = self._read(sock, _wire.Seal)
        snap = Snapshot(manifest, flat, "cpu", key=key, tags=[t.result() for t in tags])
        snap.shared = where
        self._verify(stream.key, snap, wrapped, seal)
        self.stats["streamed"] += 1
        self._expose(snap)

    def _read(self, sock: socket.socket, kind: Any) -> Any:
        return read_reply(sock, kind, self.config.max_control_bytes)

    def _read_shared(self, msg: _wire.Mapped) -> None:
        """Copy a version out of the learner's shared memory (we share its host), tagging each
        bucket as soon as it is in; exposed once the Seal, which comes once the learner has
        tagged it too, verifies and every tag matches."""
        manifest = msg.manifest
        self._check(manifest)
        version = manifest.version
        wrapped = self._inbox.wait_for(_wire.WeightsKey, version, self.config.weights_timeout)
        subscription_key = self._subscription_key()
        key = VersionKey(_keys.wrap(subscription_key, version, wrapped.wrapped))  # trusted once the Seal verifies
        flat, here = self._pool.get(manifest.total_bytes)
        buckets = manifest.buckets()
        tags: list[bytes] = []

        def tag_arrived(done: int) -> None:  # tag while the next piece is read
            tag_completed(buckets, tags, done, lambda i, a, b: key.tag(flat, a, b, version, i))

        try:
            read_into(msg.where, flat, tag_arrived)
        except OSError as exc:
            self._unreadable += 1
            if holder_gone(msg.where) and self._unreadable < 2:  # a peer's copy whose actor ended
                raise RLinkError(f"the shared copy of version {version} is gone ({exc}); "
                                 "taking it on a weights stream") from exc  # fmt: skip
            # Not readable from here after all (another PID namespace or user under the same host
            # name): stop asking for it; this version, and every later one, comes another way.
            self.conn.subscription = _wire.Subscribe(self._nonce, False)
            self.io.soon(self._send, self.conn.subscription)
            raise RLinkError(f"shared weights cannot be read here ({exc}); "
                             "taking versions on a weights stream instead") from exc
        self._unreadable = 0
        # The Seal comes once the learner computed its tags, meanwhile.
        snap = Snapshot(manifest, flat, "cpu", key=key, tags=tags)
        snap.shared = here
        self._seal_and_expose("shared_reads", snap, subscription_key, wrapped)

    def _seal_and_expose(self, path: str, snap: Snapshot, subscription_key: bytes, wrapped: _wire.WeightsKey,
                         timeout: float | None = None) -> None:  # fmt: skip
        """Wait for the version's Seal (up to ``timeout``, default ``weights_timeout``), check it
        and the tags we computed (``snap.tags``) against it, and expose ``snap``, counted under
        ``path``."""
        seal = self._inbox.wait_for(_wire.Seal, snap.version, timeout or self.config.weights_timeout)
        self._verify(subscription_key, snap, wrapped, seal)
        self.stats[path] += 1
        self._expose(snap)

    def close(self) -> None:
        self._closed = True
        for link in (self._stream, self._relay_in):
            if link is not None:  # a read in progress returns at once
                try:
                    link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        with self._cv:
            self._cv.notify_all()
        self._thread.join(self.config.close_timeout)
        if self._tagger is not None:
            self._tagger.shutdown(wait=True)

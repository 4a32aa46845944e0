"""The learner's weight fan-out: snapshots, process-group generations, broadcasts and pulls.

``publish`` copies the parameters into a flat buffer and returns; a fan-out thread then
broadcasts the newest version (older pending ones are skipped: actors only want the newest)
to every subscribed actor that is caught up, in a torch.distributed group made for exactly
those actors. The group meets through a store relayed over each member's authenticated control
connection (``rendezvous.py``): no store listens anywhere. An actor that is new, slow, frozen
or failed a broadcast is left out of the group and pulls the version over its own
authenticated connection instead; once it has caught up it joins the next generation. Either
way every bucket carries a tag keyed with the version's secret, which reaches each actor
wrapped under its own key (``wire/keys.py``). Every step is bounded by ``Config.weights_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..config import Config
from ..errors import AuthError, Closed, ProtocolError
from ..transport import hostname
from ..transport.control import ControlConnection
from ..transport.sockopts import set_congestion
from ..wire import auth as _auth
from ..wire import keys as _keys
from ..wire import messages as _wire
from .group import formation_timeout, new_group, wait_all
from .mac import have_torch
from .rendezvous import KeyValue, LocalStore, answer, relay_store
from .snapshot import BufferPool, Snapshot, begin_snapshot, fill, sources, state_dict_of


class Member(Protocol):
    """One actor's session as the publisher sees it (a ``session.Member``)."""

    id: int
    state: str  # "open" while the actor is connected
    hello: _wire.Hello
    ticket: bytes  # the session's ticket (sent in clear in the Welcome)
    key: bytes  # the session's key, from the token and the ticket (``wire.keys.session_key``)
    control: ControlConnection
    subscribed: bool  # wants every published version
    weights_shared: bool  # on this host, and reads versions from our shared memory
    cuda_device: int | None  # where it receives weights (NCCL needs distinct GPUs)
    weights_sent: int  # newest version announced or broadcast to it
    weights_acked: int  # newest version it confirmed complete and verified


class Owner(Protocol):
    """The learner side the publisher serves (a ``session.LearnerServer``)."""

    config: Config
    loop: asyncio.AbstractEventLoop
    host: str
    token: bytes | None  # the shared token: every weights key derives from it
    version: int  # the newest published version: the publisher advances it
    sessions: dict[int, Any]  # session id -> Member


@dataclass
class _Pull:
    key: bytes  # this pull's key (fresh by both nonces)
    proof: bytes  # the learner's proof, sent first on the pull connection


log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, server: Owner):
        self.server = server
        self.config = server.config
        self.loop = server.loop
        self.latest: Snapshot | None = None  # the newest complete version (served to pulls)
        self.pending: Snapshot | None = None  # the newest version, possibly still being copied
        self._pool = BufferPool(shared=self.config.weights_shared_memory)
        self._publish_lock = threading.Lock()  # one snapshot at a time
        self._cv = threading.Condition()  # guards latest/_fanned; signals acks
        self._fanned = 0  # newest version whose fan-out has ended
        self._burned = 0  # newest version whose publish failed after its fan-out could start
        self._thread: threading.Thread | None = None
        self._closed = False
        self._group: Any = None
        self._group_store: Any = None  # the group's store: torch keeps only its C++ side alive
        self._group_key: tuple[Any, ...] = ()
        self._generation = 0
        self.rendezvous = KeyValue()
        self._subscription_keys: dict[int, bytes] = {}  # session id -> its subscription's key
        self._pulls: dict[int, _Pull] = {}  # session id -> the pull just verified, until served
        self._pull_only: set[int] = set()  # sessions of actors without torch: never in a group
        self.stats: dict[str, Any] = {
            "published": 0, "fanouts": 0, "skipped_versions": 0, "fanout_failures": 0, "groups": 0, "shared": 0,
            "pulls_served": 0, "pull_bytes": 0, "last_fanout_seconds": None, "last_error": None, "backend": None,
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
        when ``timeout`` passed first (a slow or frozen actor: it will pull later)."""
        deadline = time.monotonic() + (self.config.weights_timeout if timeout is None else timeout)
        with self._cv:
            while not self._closed:
                if self._fanned >= version and all(s.weights_acked >= version for s in self._subscribers()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.25))
        return False

    def _subscribers(self) -> list[Member]:
        return [s for s in list(self.server.sessions.values()) if s.state == "open" and s.subscribed]

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
    def on_got(self, session: Member, version: int) -> None:
        with self._cv:
            session.weights_acked = max(session.weights_acked, version)
            self._cv.notify_all()

    def on_subscribe(self, session: Member, msg: _wire.Subscribe) -> None:
        nonce = getattr(msg, "nonce", b"")
        if not isinstance(msg, _wire.KeyedSubscribe) or len(nonce) != _auth.NONCE_BYTES:
            raise ProtocolError("weights subscription without a key nonce (an actor of an older rlink?)")
        self._subscription_keys[session.id] = _keys.subscription_key(session.key, nonce)
        session.subscribed = True
        # An actor that can open our memfds reads versions from them: on this host only (the
        # name says so; the actor falls back to pulls where the memfd still cannot be opened).
        session.weights_shared = bool(msg.shared) and self._pool.shared and session.hello.host == hostname()
        session.cuda_device = msg.cuda_device if msg.cuda_device >= 0 else None
        if getattr(msg, "groups", True):
            self._pull_only.discard(session.id)
        else:  # no torch.distributed on that actor: it reads shared memory or pulls
            self._pull_only.add(session.id)
        # The actor pulls the current version right away; until it acknowledges it, it stays
        # out of the broadcast group.
        session.weights_sent = self.server.version
        with self._cv:
            self._cv.notify_all()

    def on_store(self, session: Member, msg: _wire.StoreRequest) -> None:
        """An actor's rendezvous request, answered on its control connection."""
        answer(self.rendezvous, session.id, msg, session.control.send, self.loop)

    def verify_pull(self, msg: _wire.Pull, nonce: bytes) -> Member:
        """Check a pull connection's proof (on the loop, right before :meth:`serve_pull`)."""
        session: Member | None = self.server.sessions.get(msg.session)
        if session is None or session.state != "open":
            raise AuthError("weights pull for an unknown session")
        actor_nonce = getattr(msg, "nonce", b"")
        if not isinstance(msg, _wire.KeyedPull) or len(actor_nonce) != _auth.NONCE_BYTES:
            raise AuthError("weights pull without a fresh nonce (an actor of an older rlink?)")
        key = session.key
        _auth.verify(_keys.pull_proof(key, "actor", nonce, actor_nonce, session.id), msg.mac, "weights pull")
        self._pulls[session.id] = _Pull(_keys.pull_key(key, nonce, actor_nonce),
                                        _keys.pull_proof(key, "learner", nonce, actor_nonce, session.id))  # fmt: skip
        return session

    async def serve_pull(self, conn: Any, session: Member, have: int) -> None:
        """Answer a pull: the learner's proof, then the newest version's manifest, its key and
        Seal for this pull, and its bytes; or Version if none is newer."""
        pull = self._pulls.pop(session.id, None)  # before any await: verify_pull just set it
        if pull is None:
            raise AuthError("weights pull without a verified proof")
        send = self.loop.sock_sendall
        await send(conn.sock, _wire.encode(_wire.Proof(pull.proof)))
        snap = self.latest
        if snap is None or snap.version <= have:
            await send(conn.sock, _wire.encode(_wire.Version(self.server.version)))
            return
        host = await self.loop.run_in_executor(None, self._host_copy, snap) if snap.device != "cpu" else snap
        set_congestion(conn.sock, self.config.tcp_congestion)  # a whole model goes out on it
        wrapped, seal = self._seal(pull.key, host)
        async with asyncio.timeout(self.config.weights_timeout):
            await send(conn.sock, b"".join(_wire.encode(m) for m in (_wire.Publish(0, host.manifest), wrapped, seal)))
            await send(conn.sock, memoryview(host.flat))
        session.weights_sent = max(session.weights_sent, host.version)
        self.stats["pulls_served"] += 1
        self.stats["pull_bytes"] += host.manifest.total_bytes

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
        self._drop_group()

    def _fan_out(self, snap: Snapshot) -> None:
        timeout = self.config.weights_timeout
        for gone in [i for i in list(self._subscription_keys) if i not in self.server.sessions]:
            self._subscription_keys.pop(gone, None)
            self._pull_only.discard(gone)
        sessions = [s for s in list(self.server.sessions.values()) if s.state == "open"]
        subscribed = [s for s in sessions if s.subscribed]
        caught_up = [s for s in subscribed if s.weights_acked >= s.weights_sent and s.id in self._subscription_keys]
        # Actors on this host read a host snapshot from our shared memory; the others join the group.
        sharing = [s for s in caught_up if s.weights_shared and snap.shared is not None]
        caught_up = [s for s in caught_up if s not in sharing and s.id not in self._pull_only] if have_torch() else []
        backend = "nccl" if snap.device != "cpu" and caught_up and _distinct_gpus(snap.device, caught_up) else "gloo"
        source = snap if snap.device == "cpu" or backend == "nccl" else self._host_copy(snap)
        members: list[Member] = []
        if caught_up:
            try:
                self._ensure_group(caught_up, backend, snap.device)
                members = caught_up
            except Exception as exc:  # noqa: BLE001 - a member that never joined: everyone pulls
                self._failed(f"building fan-out group {self._generation} failed: {exc}")
        for s in subscribed:
            s.weights_sent = snap.version
        others = [s for s in sessions if s not in members and s not in sharing]
        keys = {s.id: self._subscription_keys[s.id] for s in members + sharing}
        for s in members:  # the key first: members tag each bucket as it arrives
            self._send([s], _wire.Publish(self._generation, source.manifest), self._weights_key(keys[s.id], snap))
        early = bool(sharing) and not members
        if early:  # every bucket copied: they read while the tags are computed
            snap.wait_ready(len(snap.manifest.buckets()), timeout)
            self._map(sharing, snap, keys)
        if members:
            try:
                self._stream(source, members, keys, timeout)
            except Exception as exc:  # noqa: BLE001 - a member died or froze mid-broadcast
                self._failed(f"broadcast of version {snap.version} failed: {exc}")
                others += [s for s in members if s.state == "open"]
                members = []
        snap.wait_ready(len(snap.manifest.buckets()) + 1, timeout)
        if not early:
            self._map(sharing, snap, keys)
        for s in sharing:  # once every tag is computed
            self._send([s], self._seal(keys[s.id], snap)[1])
        self.stats["shared"] += len(sharing)
        self._send(others, _wire.Version(snap.version))  # once complete: they pull it
        members += sharing
        if not members:
            return
        # Wait (bounded) until the members verified it: "published" means received, and an
        # actor that does not confirm in time is left out of the next group (it will pull).
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(s.state == "open" and s.weights_acked < snap.version for s in members):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cv.wait(min(left, 0.25))

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

    def _stream(self, source: Snapshot, members: list[Member], keys: dict[int, bytes], timeout: float) -> None:
        """Broadcast each bucket as soon as it is copied; send each member its Seal once every
        bucket is tagged (the tags are computed while the first buckets are on their way)."""
        works = []
        for i, (a, b) in enumerate(source.manifest.buckets()):
            source.wait_ready(i + 1, timeout)
            works.append(self._group.broadcast(source.bucket(a, b), 0))
        source.wait_ready(len(works) + 1, timeout)
        for s in members:
            self._send([s], self._seal(keys[s.id], source)[1])
        wait_all(works, timeout)

    def _ensure_group(self, members: list[Member], backend: str, device: str) -> None:
        key = (tuple(s.id for s in members), backend)
        if self._group is not None and key == self._group_key:
            return
        self._drop_group()
        timeout = self.config.weights_timeout
        self._generation += 1
        prefix = f"rlink/{self._generation}/"
        world = len(members) + 1
        self.rendezvous.reset(self._generation, {s.id for s in members})
        for rank, s in enumerate(members, 1):  # store port 0: the store is relayed over this channel
            self._send([s], _wire.Group(self._generation, rank, world, 0, prefix, backend, timeout))
        hostname = _local_address(members[0], self.server.host)
        if backend == "nccl":  # the current CUDA device is per thread: use the snapshot's
            import torch

            torch.cuda.set_device(torch.device(device))
        log.info("fan-out group %d: %s ranks over %s", self._generation, world, backend)
        # A member whose session ends will never join: give up at once rather than at the
        # timeout (the others then pull, and the next publish builds a group without it).
        store = relay_store(LocalStore(self.rendezvous, formation_timeout(timeout, world), lambda: _gone(members)))
        self._group = new_group(store, prefix, 0, world, backend=backend, hostname=hostname, timeout=timeout)
        self._group_store = store
        self._group_key = key
        self.stats["groups"] += 1
        self.stats["backend"] = backend

    def _failed(self, why: str) -> None:
        log.warning("%s; the actors concerned pull the version instead", why)
        self.stats["fanout_failures"] += 1
        self.stats["last_error"] = why[:500]
        self._drop_group()

    def _drop_group(self) -> None:
        self._group, self._group_key, self._group_store = None, (), None
        self.rendezvous.reset(0, frozenset())

    def _send(self, sessions: list[Member], *msgs: Any) -> None:
        for s in sessions:
            for msg in msgs:
                try:
                    self.loop.call_soon_threadsafe(s.control.send, msg)
                except RuntimeError:  # the loop has stopped: the learner is closing
                    return

    def _host_copy(self, snap: Snapshot) -> Snapshot:
        """A host copy of a CUDA snapshot, for gloo and pulls (made once per version; same key
        and tags: the same bytes). It waits until the snapshot is sealed: the fan-out starts
        while ``publish`` is still copying, and a copy taken earlier would send (and cache, for
        every later pull) a half-written model."""
        if snap.device == "cpu":
            return snap
        snap.wait_ready(len(snap.manifest.buckets()) + 1, self.config.weights_timeout)
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
            "generation": self._generation,
            "group_size": len(self._group_key[0]) if self._group_key else 0,
            "model_bytes": self.latest.manifest.total_bytes if self.latest else 0,
        }

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(self.config.close_timeout)


def _gone(members: list[Member]) -> str | None:
    left = [s.id for s in members if s.state != "open"]
    return f"the session of member(s) {left} ended" if left else None


def _distinct_gpus(device: str, members: list[Member]) -> bool:
    """NCCL needs one GPU per rank: every member on CUDA, none sharing a GPU with another rank."""
    seen = {(_host_key(None), device)}
    for s in members:
        if s.cuda_device is None:
            return False
        key = (_host_key(s), f"cuda:{s.cuda_device}")
        if key in seen:
            return False
        seen.add(key)
    return True


def _host_key(session: Member | None) -> str:
    return session.hello.host if session is not None else hostname()


def _local_address(session: Member, fallback: str) -> str:
    """The learner's address on the interface this actor reached it through (for gloo)."""
    try:
        return str(session.control.sock.getsockname()[0])
    except OSError:
        return fallback

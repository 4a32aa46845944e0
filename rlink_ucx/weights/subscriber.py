"""The actor's side of the weight fan-out: keeps the newest version ready, double-buffered.

A background thread joins the learner's broadcast groups and receives each version into a
buffer nobody else is reading, or pulls it over an authenticated connection of its own when it
is not in a group (just subscribed, slow, or a broadcast failed). Only a complete version whose
every bucket matched its checksum is exposed, so ``get_remote_model`` never sees a half-written
one, and costs no network round trip when nothing changed.
"""

from __future__ import annotations

import logging
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from ..config import Config
from ..errors import Closed, ProtocolError, RLinkError
from ..errors import TimeoutError as RLinkTimeout
from ..transport.control import ControlConnection
from ..transport.loop import IOThread
from ..wire import auth as _auth
from ..wire import messages as _wire
from .group import broadcast, connect_store, new_group
from .snapshot import BufferPool, Snapshot, checksum

log = logging.getLogger(__name__)



class Link(Protocol):
    """The actor's connection as the subscriber sees it (a ``session.ActorConnection``)."""

    host: str
    port: int
    actor_id: int | None
    latest_version: int  # the newest version the learner announced
    error: RLinkError | None  # set once the connection failed for good
    welcome: _wire.Welcome | None  # session id and ticket: a pull proves them
    control: ControlConnection | None
    weights_listener: Callable[[Any], None] | None  # gets Version/Publish/Group/Sealed messages
    subscription: Any  # the Subscribe message, repeated after a reconnect


_PULL = object()  # event: pull now, whatever the announced version


class Subscriber:
    def __init__(self, conn: Link, io: IOThread, config: Config):
        self.conn = conn
        self.io = io
        self.config = config
        self.ready: Snapshot | None = None
        self._tensors: dict[str, Any] | None = None  # views of ``ready``, made on first use
        self._pool = BufferPool()
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._closed = False
        self._group: Any = None
        self._generation = 0
        self._backend = "gloo"
        self._stores: dict[int, Any] = {}
        self.stats: dict[str, Any] = {"broadcasts": 0, "pulls": 0, "failures": 0, "last_error": None}
        conn.weights_listener = self.deliver
        self._device = _cuda_device()  # the caller's GPU: NCCL receives land there
        self._thread = threading.Thread(target=self._run, name="rlink-weights", daemon=True)
        self._thread.start()
        conn.subscription = _wire.Subscribe(self._device)  # repeated after a reconnect
        io.soon(self._send, conn.subscription)
        self._events.put(_PULL)

    @property
    def have(self) -> int:
        return self.ready.version if self.ready is not None else 0

    # --- I/O loop: control messages from the learner ----------------------------------------
    def deliver(self, msg: Any) -> None:
        with self._cv:
            self._cv.notify_all()  # conn.latest_version moved: waiters re-check
        self._events.put(msg)

    def _send(self, msg: Any) -> None:
        if self.conn.control is not None:
            self.conn.control.send(msg)

    # --- caller's thread ----------------------------------------------------------------------
    def get(self, timeout: float | None, latest: bool) -> tuple[dict[str, Any], int]:
        """The newest complete version (waiting for it up to ``timeout``)."""
        limit = self.config.weights_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cv:
            while True:
                ready = self.ready
                if ready is not None and (not latest or ready.version >= self.conn.latest_version):
                    break
                if self._closed:
                    raise Closed("the actor is closed")
                if self.conn.error is not None:
                    raise type(self.conn.error)(str(self.conn.error)) from self.conn.error
                left = deadline - time.monotonic()
                if left <= 0:
                    newest = self.conn.latest_version
                    raise RLinkTimeout(
                        f"no weights within {limit:.3g}s: the learner has version {newest}, this actor "
                        f"{self.have or 'none'}" + ("" if newest else " (nothing published yet)")
                    )
                self._cv.wait(min(left, 0.25))
            if self._tensors is None:
                self._tensors = ready.tensors()
            return dict(self._tensors), ready.version

    # --- weights thread -----------------------------------------------------------------------
    def _run(self) -> None:
        if self._device >= 0:  # the current CUDA device is per thread: NCCL must use the caller's
            import torch

            torch.cuda.set_device(self._device)
        while not self._closed:
            try:
                msg = self._events.get(timeout=0.25)
            except queue.Empty:
                continue
            try:
                if msg is _PULL or (isinstance(msg, _wire.Version) and msg.version > self.have):
                    self._pull()
                elif isinstance(msg, _wire.Group):
                    self._join(msg)
                elif isinstance(msg, _wire.Publish):
                    self._receive(msg)
            except Exception as exc:  # noqa: BLE001 - logged and counted; the next version retries
                self._group = None
                self.stats["failures"] += 1
                self.stats["last_error"] = repr(exc)[:500]
                if not self._closed:
                    log.warning("actor %s: weights update failed: %s", self.conn.actor_id, exc)
                    if self.conn.latest_version > self.have and not isinstance(msg, _wire.Version):
                        self._events.put(_PULL)
                    elif isinstance(msg, _wire.Version):
                        time.sleep(min(1.0, self.config.heartbeat_interval))  # do not spin on a broken pull
                        self._events.put(_PULL)
        self._group = None

    def _expose(self, snap: Snapshot) -> None:
        with self._cv:
            if self.ready is None or snap.version > self.ready.version:
                self.ready, self._tensors = snap, None
            self._cv.notify_all()
        self.io.soon(self._send, _wire.Got(snap.version))

    def _check(self, manifest: Any) -> None:
        manifest.validate(max_bytes=self.config.max_weights_bytes, max_entries=self.config.max_weights_tensors)

    def _pull(self) -> None:
        """Fetch the newest version over a connection of our own (authenticated by the
        session's ticket), unless it is no newer than what we have."""
        welcome = self.conn.welcome
        assert welcome is not None
        sock = socket.create_connection((self.conn.host, self.conn.port), timeout=self.config.handshake_timeout)
        try:
            sock.settimeout(self.config.weights_timeout)
            challenge = _wire.read_message(sock, self.config.max_preauth_bytes)
            if not isinstance(challenge, _wire.Challenge):
                raise ProtocolError(f"expected Challenge, got {type(challenge).__name__}")
            mac = _auth.pull_proof(welcome.ticket, challenge.nonce, welcome.session)
            sock.sendall(_wire.encode(_wire.Pull(_wire.PROTOCOL_VERSION, welcome.session, mac, self.have)))
            reply = _wire.read_message(sock, self.config.max_control_bytes)
            if isinstance(reply, _wire.Version):
                return  # nothing newer than what we have
            if isinstance(reply, _wire.Error):
                raise ProtocolError(f"learner refused the weights pull: {reply.text}")
            if not isinstance(reply, _wire.Publish):
                raise ProtocolError(f"expected Publish, got {type(reply).__name__}")
            self._check(reply.manifest)
            flat = self._pool.get(reply.manifest.total_bytes)
            _wire.recv_exact_into(sock, memoryview(flat))
            snap = Snapshot(reply.manifest, flat, "cpu")
            snap.verify()
        finally:
            sock.close()
        self.stats["pulls"] += 1
        self._expose(snap)

    def _join(self, msg: _wire.Group) -> None:
        self._group = None
        store = self._stores.get(msg.store_port)
        if store is None:
            store = self._stores[msg.store_port] = connect_store(self.conn.host, msg.store_port, msg.timeout)
        assert self.conn.control is not None
        hostname = str(self.conn.control.sock.getsockname()[0])
        self._group = new_group(store, msg.prefix, msg.rank, msg.world, backend=msg.backend, hostname=hostname,
                                timeout=msg.timeout)  # fmt: skip
        self._generation, self._backend = msg.generation, msg.backend

    def _receive(self, msg: _wire.Publish) -> None:
        manifest = msg.manifest
        self._check(manifest)
        if self._group is None or msg.generation != self._generation:
            raise ProtocolError(f"broadcast for group {msg.generation}, which this actor is not in")
        if self._backend == "nccl":
            import torch

            flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=torch.device("cuda", self._device))
        else:
            flat = self._pool.get(manifest.total_bytes)
        buckets = manifest.buckets()
        sums: list[int] = []
        receiving = Snapshot(manifest, flat, "cpu" if self._backend == "gloo" else str(flat.device))
        broadcast(self._group, [receiving.bucket(a, b) for a, b in buckets], self.config.weights_timeout,
                  on_done=lambda i: sums.append(checksum(flat, *buckets[i], manifest.checksum)))  # fmt: skip
        expected = manifest.checksums or self._await_sealed(manifest.version)
        bad = [i for i, (want, got) in enumerate(zip(expected, sums)) if want != got]
        if bad or len(expected) != len(sums):
            raise ProtocolError(f"weights version {manifest.version}: checksum mismatch in buckets {bad}")
        self.stats["broadcasts"] += 1
        self._expose(Snapshot(msgspec.structs.replace(manifest, checksums=expected), flat, receiving.device))

    def _await_sealed(self, version: int) -> list[int]:
        """The checksums of a version whose buckets were streamed while being copied."""
        try:
            msg = self._events.get(timeout=self.config.weights_timeout)
        except queue.Empty:
            raise ProtocolError(f"no checksums for weights version {version}") from None
        if not isinstance(msg, _wire.Sealed) or msg.version != version:
            raise ProtocolError(f"expected the checksums of version {version}, got {type(msg).__name__}")
        return list(msg.checksums)

    def close(self) -> None:
        self._closed = True
        with self._cv:
            self._cv.notify_all()
        self._thread.join(self.config.close_timeout)


def _cuda_device() -> int:
    """The current CUDA device if torch (already imported) sees one, else -1."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return -1
    return int(torch.cuda.current_device())

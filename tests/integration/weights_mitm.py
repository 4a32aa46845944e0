"""A man in the middle between actors and a learner, for the weights and attach attack tests.

It relays every connection to the learner's port (control, data plane, weights streams) and may
rewrite what the learner sends: flip bytes of a streamed model, and put plain checksums that
match the altered bytes where a message carries any (an unkeyed checksum is no defence against
anyone on the path); answer weights streams itself; or take data connections itself and tell the
actor they are ready. It never holds the token.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import xxhash

from rlink_ucx.wire import messages as _wire


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[bytes, Any]:
    head = recv_exact(sock, 4)
    body = recv_exact(sock, _wire.LENGTH.unpack(head)[0])
    return head + body, _wire.decode(body)


def flip(data: bytes, where: int = 0) -> bytes:
    """``data`` with one byte inverted."""
    out = bytearray(data)
    out[where] ^= 0xFF
    return bytes(out)


def plain_checksums(manifest: Any, flat: bytes) -> list[int]:
    """XXH3-64 per bucket: what an unkeyed manifest would carry for ``flat``."""
    return [xxhash.xxh3_64_intdigest(flat[a:b]) for a, b in manifest.buckets()]


class WeightsMitm:
    """Relays ``127.0.0.1:<port>`` to the learner. ``tamper_streams``: streamed models arrive with
    one byte flipped (and plain checksums recomputed to match); ``tamper_once``: only that
    version, the first time. ``rewrite``: called with every
    control message the learner sends on a control connection; returns the message to forward."""

    def __init__(self, learner_port: int, *, tamper_streams: bool = False, tamper_once: int = 0,
                 rewrite: Callable[[Any], Any] | None = None, fake_streams: Callable[[], tuple[Any, bytes]] | None = None, fake_data: bool = False):  # fmt: skip
        self.learner_port = learner_port
        self.fake_data = fake_data  # take data connections itself, and tell the actor Ready
        self.data_bytes = 0  # what actors sent to a data connection taken that way
        self.tamper_streams = tamper_streams
        self.tamper_once = tamper_once  # this version is altered the first time it passes (all: tamper_streams)
        self.rewrite = rewrite
        self.fake_streams = fake_streams  # answer weights streams with this (manifest, bytes) instead of relaying
        self.streams_faked = 0
        self.streams_tampered = 0
        self.rewritten = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._socks: list[socket.socket] = []
        self._controls: list[socket.socket] = []  # actor side of each control connection
        self._locks: dict[socket.socket, threading.Lock] = {}  # one writer at a time per socket
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                actor, _ = self._listener.accept()
            except OSError:
                return
            learner = socket.create_connection(("127.0.0.1", self.learner_port))
            self._socks += [actor, learner]
            self._locks[actor] = threading.Lock()
            kind: dict[str, str] = {}
            threading.Thread(target=self._upstream, args=(actor, learner, kind), daemon=True).start()
            threading.Thread(target=self._downstream, args=(learner, actor, kind), daemon=True).start()

    def _upstream(self, actor: socket.socket, learner: socket.socket, kind: dict[str, str]) -> None:
        """Actor -> learner: note what the connection is (its first message), then relay."""
        try:
            raw, first = read_frame(actor)
            if isinstance(first, _wire.OpenStream) and self.fake_streams is not None:
                kind["is"] = "fake"
                actor.sendall(self._fake_stream())
                return
            if isinstance(first, _wire.Attach) and self.fake_data:
                kind["is"] = "fake"
                learner.close()
                for control in self._controls:  # the learner never saw this Attach: say Ready for it
                    with self._locks[control]:
                        control.sendall(_wire.encode(_wire.Ready("tcp")))
                while chunk := actor.recv(1 << 16):
                    self.data_bytes += len(chunk)
                return
            kind["is"] = ("stream" if isinstance(first, _wire.OpenStream) else "data" if isinstance(first, _wire.Attach)
                          else "control")  # fmt: skip
            if kind["is"] == "control":
                self._controls.append(actor)
            learner.sendall(raw)
            while chunk := actor.recv(1 << 16):
                learner.sendall(chunk)
        except (OSError, EOFError, msgspec.DecodeError):
            pass
        finally:
            _shut(learner)

    def _downstream(self, learner: socket.socket, actor: socket.socket, kind: dict[str, str]) -> None:
        """Learner -> actor: control messages one by one (rewritten if asked), a streamed model
        as its messages plus its raw bytes."""
        try:
            actor.sendall(read_frame(learner)[0])  # the Challenge: the actor answers it
            while True:
                raw, msg = read_frame(learner)
                while "is" not in kind:  # the actor's first message classifies the connection
                    time.sleep(0.001)
                if kind["is"] == "fake":
                    return
                if kind["is"] == "data":  # nothing but relaying on a data connection
                    actor.sendall(raw)
                    while chunk := learner.recv(1 << 16):
                        actor.sendall(chunk)
                    return
                if kind["is"] == "stream" and isinstance(msg, _wire.Publish):
                    actor.sendall(self._streamed_model(learner, msg))
                    continue
                if kind["is"] == "control" and self.rewrite is not None:
                    new = self.rewrite(msg)
                    if new is not msg:
                        self.rewritten += 1
                        raw = _wire.encode(new)
                with self._locks[actor]:
                    actor.sendall(raw)
        except (OSError, EOFError, msgspec.DecodeError):
            pass
        finally:
            _shut(actor)

    def _fake_stream(self) -> bytes:
        """A weights stream answered without the learner: a model of the attacker's choosing, with
        plain checksums that match it where the format has any; the actor first wants the learner's
        proof, which cannot be computed without the token: a made-up one goes out."""
        assert self.fake_streams is not None
        manifest, flat = self.fake_streams()
        self.streams_faked += 1
        proof = _wire.encode(_wire.Proof(bytes(32)))
        return proof + _wire.encode(_wire.Publish(manifest)) + flat

    def _streamed_model(self, learner: socket.socket, publish: Any) -> bytes:
        """One version sent on a weights stream, from its Publish to its Seal, its bytes
        altered if ``tamper_streams``. WeightsKey (before the bytes) and Seal (after them) are
        passed through: they cannot be forged."""
        between = [read_frame(learner)[0]]  # WeightsKey
        flat = recv_exact(learner, publish.manifest.total_bytes)
        seal = read_frame(learner)[0]
        once = publish.manifest.version == self.tamper_once and self.streams_tampered == 0
        if (self.tamper_streams or once) and flat:
            flat = flip(flat)
            self.streams_tampered += 1
            if publish.manifest.checksums:  # an unkeyed manifest: make its checksums match
                manifest = msgspec.structs.replace(publish.manifest, checksums=plain_checksums(publish.manifest, flat))
                publish = _wire.Publish(manifest)
        return _wire.encode(publish) + b"".join(between) + flat + seal


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

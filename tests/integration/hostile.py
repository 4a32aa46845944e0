"""Hand-made peers for attack tests: they speak the wire protocol themselves (blocking sockets),
so they can say what a real actor never would. Functions named ``*_proc`` run in spawned
processes and report through a queue."""

from __future__ import annotations

import ctypes
import os
import socket
import time
from typing import Any

import numpy as np

from rlink_ucx import __version__
from rlink_ucx.bench.procfs import listening_sockets
from rlink_ucx.transport import hostname
from rlink_ucx.transport.plane import decode_blob, encode_blob
from rlink_ucx.transport.shm.channel import ReadyAnswer
from rlink_ucx.transport.shm.plane import AttachDetail


def offers(*, ucx: bool, shm: bool) -> dict[str, bytes]:
    """A Hello's offers: tcp, and ucx / shm where asked."""
    return {"tcp": b"", **({"ucx": b""} if ucx else {}), **({"shm": b""} if shm else {})}
from rlink_ucx.wire import auth as _auth
from rlink_ucx.wire import keys as _keys
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.frame import FrameHeader


class RawActor:
    """One session, opened by hand: control connection, mutual proof, Hello as given."""

    def __init__(self, address: str, token: bytes | None, timeout: float = 20.0):
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.token, self.timeout = host.strip("[]"), int(port), token, timeout
        self.control = socket.create_connection((self.host, self.port), timeout=timeout)
        self.welcome: _wire.Welcome | None = None
        self.data: socket.socket | None = None

    def hello(self, *, pid: int, transport: str, shm: bool = False, ucx: bool = False,
              actor_id: int | None = None) -> _wire.Welcome:  # fmt: skip
        challenge = self.recv(self.control)
        assert isinstance(challenge, _wire.Challenge), challenge
        nonce = _auth.new_nonce()
        mac = _auth.actor_proof(self.token, challenge.nonce, nonce) if self.token else b""
        self.send(self.control, _wire.Login(_wire.PROTOCOL_VERSION, nonce, mac))
        if self.token:
            assert isinstance(self.recv(self.control), _wire.Proof)
        self.send(self.control, _wire.Hello(actor_id, 0, __version__, transport, False, hostname(), pid, offers(ucx=ucx, shm=shm)))
        welcome = self.expect(_wire.Welcome)
        self.welcome = welcome
        return welcome

    @property
    def session_key(self) -> bytes:
        """The session's key, as the token's holder derives it (``wire.keys.session_key``)."""
        assert self.welcome is not None
        return _keys.session_key(self.token, self.welcome.ticket, self.welcome.session)

    def attach(self, *, shm: bool = False, arena: Any = None, cma: Any = None,
               key: bytes | None = None) -> socket.socket:  # fmt: skip
        """Open the data connection and prove, with ``key`` (the session's key unless given),
        that it belongs to the session."""
        assert self.welcome is not None
        data = socket.create_connection((self.host, self.port), timeout=self.timeout)
        challenge = self.recv(data)
        proof = _auth.data_proof(self.session_key if key is None else key, challenge.nonce, self.welcome.session)
        detail = encode_blob(AttachDetail(True, arena, cma)) if shm else b""
        self.send(data, _wire.Attach(_wire.PROTOCOL_VERSION, self.welcome.session, proof, detail))
        self.data = data
        return data

    def propose(self, fields: list) -> _wire.Accept:
        self.send(self.control, _wire.Propose(fields))
        return self.expect(_wire.Accept)

    def expect(self, kind: type) -> Any:
        """The next message of ``kind`` on the control connection (heartbeats and the like skipped)."""
        while True:
            msg = self.recv(self.control)
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, _wire.Error):
                raise ConnectionError(f"learner refused: {msg.kind}: {msg.text}")

    @staticmethod
    def send(sock: socket.socket, msg: Any) -> None:
        sock.sendall(_wire.encode(msg))

    @staticmethod
    def recv(sock: socket.socket) -> Any:
        return _wire.read_message(sock, 1 << 20)

    def close(self) -> None:
        for sock in (self.data, self.control):
            if sock is not None:
                sock.close()


def secret_memory(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` of recognisable bytes (a victim's secret)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def victim_proc(nbytes: int, seed: int, out: Any, stop: Any) -> None:
    """A bystander process holding a secret at a known address, until ``stop`` is set."""
    secret = secret_memory(nbytes, seed)
    out.put((os.getpid(), secret.ctypes.data))
    stop.wait(120)
    del secret


def cma_impostor_proc(address: str, token: bytes, pid: int, where: int, nbytes: int, nonce: bytes, out: Any) -> None:
    """An authenticated actor on the shm plane that names process ``pid`` as its own and the
    ``nbytes`` at ``where`` in it (whose first 16 bytes are ``nonce``) as its probe, then sends
    one frame "by address" pointing there. Reports whether the learner offered direct reads."""
    actor = RawActor(address, token)
    try:
        welcome = actor.hello(pid=pid, transport="shm", shm=True)
        assert welcome.transport == "shm", welcome
        data = actor.attach(shm=True, cma=[where, nonce])
        ready = actor.expect(_wire.Ready)
        accept = actor.propose([["x", "uint8", [nbytes]]])
        actor.expect(_wire.Credit)
        from rlink_ucx.transport.shm import channel as shm
        header = FrameHeader(accept.schema_id, 1, welcome.actor_id, 0, 0, 0, nbytes).pack()
        data.sendall(shm.DIRECT_FRAME + header + shm.COUNTER.pack(1) + shm.EXTENT.pack(where, nbytes))
        out.put(("ready", bool(ready.answer) and decode_blob(ready.answer, ReadyAnswer, "ready").direct))
        time.sleep(3)  # keep the session open while the learner does (or does not) read
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(exc)))
    finally:
        actor.close()


def honest_direct_proc(address: str, token: bytes, nbytes: int, seed: int, out: Any) -> None:
    """The same hand-made actor naming its own pid and its own memory: the learner must still
    read it directly (the check refuses impostors, not actors)."""
    secret = secret_memory(nbytes, seed)
    probe = ctypes.string_at(secret.ctypes.data, 16)
    cma_impostor_proc(address, token, os.getpid(), secret.ctypes.data, nbytes, probe, out)
    del secret


def paced_int_proc(address: str, token: bytes, transport: str, stop: Any, out: Any) -> None:
    """An honest actor: int64 steps 0, 1, ... in chunks of 100 until ``stop``; reports how many
    it put and its own listening sockets."""
    from rlink_ucx import Actor

    n = 0
    with Actor(address, token=token, transport=transport, actor_id=1) as actor:
        while not stop.is_set() and n < 2_000_000:
            actor.put_many({"x": np.arange(n, n + 100, dtype=np.int64)})
            n += 100
            time.sleep(0.002)
        actor.flush(60)
        out.put((n, sorted(listening_sockets()), actor.transport))


def ucx_stranger_proc(worker_address: bytes, total: int, size: int, out: Any) -> None:
    """A process that never authenticated, with a UCX endpoint to the learner's worker (its
    address learnt in an earlier session): ``total`` bytes of ``size``-byte messages, each with
    a random 64-bit tag. Reports how many messages it sent."""
    import secrets

    from rlink_ucx import Config
    from rlink_ucx.transport.ucx.learner import load_ucxx, make_worker

    u, context, worker = make_worker(Config(), loopback=True)
    _, array = load_ucxx()
    endpoint = u.UCXEndpoint.create_from_worker_address(worker, u.UCXAddress.create_from_buffer(worker_address),
                                                        False)  # fmt: skip
    junk = array(bytearray(os.urandom(size)))
    pending: list = []
    sent = 0
    deadline = time.monotonic() + 90
    while sent * size < total and time.monotonic() < deadline:
        pending.append(endpoint.tag_send(junk, u.UCXXTag(secrets.randbits(64))))
        sent += 1
        worker.progress()
        if len(pending) >= 256:  # eager sends complete locally; keep at most 256 in flight
            while len(pending) >= 128 and time.monotonic() < deadline:
                worker.progress()
                pending = [r for r in pending if not r.completed]
    settle = time.monotonic() + 2
    while time.monotonic() < settle:
        worker.progress()
    out.put(sent)


def _send_ucx_messages(address: str, token: bytes, out: Any, messages: Any, field: Any = ("int64", [])) -> None:
    """As an authenticated ucx actor, send UCX messages, ``messages(welcome, accept, tags)`` ->
    [(bytes, tag), ...], after proposing one field ``x`` (dtype and shape ``field``); report
    what the learner said."""
    from rlink_ucx import Config
    from rlink_ucx.transport.ucx.learner import load_ucxx, make_worker, session_tags

    actor = RawActor(address, token)
    try:
        welcome = actor.hello(pid=os.getpid(), transport="ucx", ucx=True)
        actor.expect(_wire.Ready)
        accept = actor.propose([["x", *field]])
        actor.expect(_wire.Credit)
        u, context, worker = make_worker(Config(), loopback=True)
        _, array = load_ucxx()
        endpoint = u.UCXEndpoint.create_from_worker_address(
            worker, u.UCXAddress.create_from_buffer(welcome.answer), False)  # fmt: skip
        sent = messages(welcome, accept, session_tags(actor.session_key))
        keep = [(array(bytearray(data)), tag) for data, tag in sent]
        requests = [endpoint.tag_send(data, u.UCXXTag(tag)) for data, tag in keep]
        deadline = time.monotonic() + 5
        while not all(r.completed for r in requests) and time.monotonic() < deadline:
            worker.progress()
        actor.control.settimeout(10)
        try:
            actor.expect(_wire.Bye)  # never comes: the learner reports an error or closes
            out.put("bye")
        except ConnectionError as exc:
            out.put(str(exc))
        except (OSError, EOFError) as exc:
            out.put(f"closed: {exc!r}")
    finally:
        actor.close()


def _unannounced_payload(welcome: Any, accept: Any, tags: tuple[int, int]) -> list[tuple[bytes, int]]:
    return [(bytes(4096), tags[1])]  # the session's own payload tag, no header before it


def _short_header(welcome: Any, accept: Any, tags: tuple[int, int]) -> list[tuple[bytes, int]]:
    # One step of the int64 field: 8 bytes, which ride inside the header's message; none do.
    return [(FrameHeader(accept.schema_id, 1, welcome.actor_id, 0, 0, 0, 8).pack(), tags[0])]


def _short_payload(field_bytes: int) -> Any:
    def messages(welcome: Any, accept: Any, tags: tuple[int, int]) -> list[tuple[bytes, int]]:
        # One step of the field, its message 1 KiB short: UCX itself would accept it into the
        # field's receive and call the receive complete.
        header = FrameHeader(accept.schema_id, 1, welcome.actor_id, 0, 0, 0, field_bytes).pack()
        return [(header, tags[0]), (b"\xab" * (field_bytes - 1024), tags[1])]

    return messages


def ucx_unannounced_payload_proc(address: str, token: bytes, out: Any) -> None:
    """An authenticated ucx actor that sends a payload message (its session's own payload tag)
    with no frame header before it. Reports what the learner said."""
    _send_ucx_messages(address, token, out, _unannounced_payload)


def ucx_short_header_proc(address: str, token: bytes, out: Any) -> None:
    """An authenticated ucx actor whose frame header announces a step of one int64 field (8
    bytes, small enough to travel inside the header's message) but sends the header alone.
    Reports what the learner said."""
    _send_ucx_messages(address, token, out, _short_header)


def ucx_short_payload_proc(address: str, token: bytes, out: Any, field_bytes: int) -> None:
    """An authenticated ucx actor whose frame header announces one step of a ``field_bytes``
    field (too large to ride in the header's message) and whose payload message is 1 KiB short.
    Reports what the learner said."""
    _send_ucx_messages(address, token, out, _short_payload(field_bytes), ("uint8", [field_bytes]))


def ucx_stalled_actor_proc(address: str, token: bytes, out: Any, stop: Any) -> None:
    """An authenticated ucx actor that sends a valid frame header, never its payload, and the
    next frame's header: that one waits, kept, at the head of the learner's unexpected queue.
    Its one field is larger than ``HEADER_MESSAGE_BYTES``, so the payload is a message of its own
    (a smaller field would travel inside the header's message)."""
    from rlink_ucx import Config
    from rlink_ucx.transport.ucx.learner import load_ucxx, make_worker, session_tags
    from rlink_ucx.transport.ucx.setup import HEADER_MESSAGE_BYTES

    actor = RawActor(address, token)
    try:
        welcome = actor.hello(pid=os.getpid(), transport="ucx", ucx=True)
        actor.expect(_wire.Ready)
        accept = actor.propose([["x", "uint8", [2 * HEADER_MESSAGE_BYTES]]])
        actor.expect(_wire.Credit)
        u, context, worker = make_worker(Config(), loopback=True)
        _, array = load_ucxx()
        endpoint = u.UCXEndpoint.create_from_worker_address(
            worker, u.UCXAddress.create_from_buffer(welcome.answer), False)  # fmt: skip
        header_tag, _ = session_tags(actor.session_key)
        step_bytes = 2 * HEADER_MESSAGE_BYTES
        keep = [array(bytearray(FrameHeader(accept.schema_id, 1, welcome.actor_id, 0, seq, 0, step_bytes).pack()))
                for seq in (0, 1)]  # fmt: skip
        requests = [endpoint.tag_send(k, u.UCXXTag(header_tag)) for k in keep]
        deadline = time.monotonic() + 10
        while not all(r.completed for r in requests) and time.monotonic() < deadline:
            worker.progress()
        out.put("stalled")
        while not stop.wait(0.01):
            worker.progress()
    finally:
        actor.close()

"""Fuzzing what the learner reads from the network, shared by ``tests/unit/test_fuzz.py``
(hypothesis, a short run in CI) and ``bench/fuzz.py`` (random inputs for as long as asked).

Inputs are built from a ``random.Random`` (hypothesis hands one over and shrinks through
it). Each target of :class:`Lab` feeds one input to real learner code at one stage of a
connection and names the outcome; an exception the stage does not allow, a tracemalloc peak
over the bound or a run over the time bound raises :class:`Finding`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import socket
import time
import tracemalloc
import typing
from typing import Any

import msgspec

from rlink_ucx import Config
from rlink_ucx.errors import AuthError, PeerLost, ProtocolError, SchemaMismatch
from rlink_ucx.session.learner.attach import attach_data_connection
from rlink_ucx.session.learner.outcome import Kind
from rlink_ucx.session.learner.server import LearnerServer
from rlink_ucx.session.learner.session import LearnerSession
from rlink_ucx.transport import hostname
from rlink_ucx.transport.control import ControlConnection
from rlink_ucx.transport.plane import encode_blob
from rlink_ucx.transport.shm import channel as shm
from rlink_ucx.transport.shm import records as shm_records
from rlink_ucx.transport.shm.channel import ReadyAnswer
from rlink_ucx.transport.shm.plane import AttachDetail, RingAnswer, ShmOpening, ShmPlane
from rlink_ucx.wire import auth as _auth
from rlink_ucx.wire import messages as _wire
from rlink_ucx.wire.frame import FRAME_HEADER, FRAME_HEADER_BYTES, FrameHeader
from rlink_ucx.wire.manifest import KEYED, Entry, Manifest
from tests.unit.test_validation import SCHEMA, make_session

MESSAGE_TYPES: tuple[type, ...] = typing.get_args(_wire.Message)
TOKEN = b"fuzz-token-0123456789abcdef"
PV = _wire.PROTOCOL_VERSION
EDGE_INTS = (0, 1, -1, 7, 255, 256, 512, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**33, 2**40, 2**53 + 1,
             2**63 - 1, 2**63, 2**64 - 1, -(2**31), -(2**63))  # fmt: skip
# msgpack headers that claim 4 GiB (str, bin, array, map, ext) with nothing behind them, a
# byte msgpack never uses, and a fixext cut short.
CLAIMS = tuple(msgspec.Raw(r) for r in (b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                                        b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xc1", b"\xd4"))  # fmt: skip
ALLOWED = (ProtocolError, AuthError, SchemaMismatch, PeerLost)  # the typed refusals


class Finding(AssertionError):
    """An input the learner handled badly: an untyped exception, too much memory or time."""


def deep(depth: int) -> msgspec.Raw:
    """``[[[...[nil]...]]]``, ``depth`` lists deep (built as bytes: encoding it would recurse)."""
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


def valid_examples() -> list[Any]:
    """One valid message of every type (the seeds that hostile ones are made from)."""
    nonce, mac = bytes(range(32)), bytes(32)
    manifest = Manifest(1, [Entry("w", "float32", [4], 0)], 16, 1 << 20, [], KEYED)
    return [
        _wire.Challenge(PV, nonce, True), _wire.Login(PV, nonce, mac), _wire.Proof(mac),
        _wire.Attach(PV, 1, mac, encode_blob(AttachDetail(True, [os.getpid(), 3, bytes(16), 1 << 16], [1 << 20, bytes(16)]))),
        _wire.Hello(7, 0, "0.1", "tcp", False, hostname(), os.getpid(), {"tcp": b"", "shm": b""}),
        _wire.Welcome(1, 7, 0, "shm", "why", bytes(32), 1 << 20, 1.0, 10.0, -1, encode_blob(RingAnswer(1, 3, bytes(16), 1 << 16))),
        _wire.Propose([["x", "float32", [4]], ["done", "bool", []]]), _wire.Accept(1, 100), _wire.Reject("no"),
        _wire.Ready("shm", encode_blob(ReadyAnswer(True, False))), _wire.Credit(10, 0), _wire.Revoke(5), _wire.Returned(0), _wire.Sync(10),
        _wire.Ack(10), _wire.Subscribe(nonce, True), _wire.Version(1), _wire.Publish(manifest), _wire.Got(1),
        _wire.OpenStream(PV, 1, mac, 0, nonce), _wire.Heartbeat(), _wire.Bye("done"), _wire.Error("protocol", "x"),
        _wire.WeightsKey(1, nonce), _wire.Seal(1, [bytes(16)], mac), _wire.AttachProof(mac),
        _wire.Mapped(manifest, [os.getpid(), 3, bytes(16), 16]),
        _wire.Redirect(1, "127.0.0.1", 9, 7), _wire.RankHello(1, 2, "127.0.0.1", 9), _wire.RankWelcome(2),
        _wire.RankActors([1, 2, 3]), _wire.StatsRequest(), _wire.StatsReply({"rank": 0, "actors": [], "ranks": {1: {}}}),
        _wire.RelayServe(nonce), _wire.RelayAt(nonce, 9), _wire.RelayFrom(2, "127.0.0.1", 9, nonce, mac),
        _wire.Relayed(2, True), _wire.RelayOpen(PV, nonce, mac, nonce, 1),
        _wire.BroadcastJoin(1, "127.0.0.1", 9, "ab" * 16 + "/1/", 1, 3, "gloo"), _wire.BroadcastJoined(1, True),
        _wire.Broadcast(1, manifest),
    ]  # fmt: skip


_SEEDS = {type(m): msgspec.msgpack.decode(msgspec.msgpack.encode(m)) for m in valid_examples()}  # [tag, *fields]


def _bytes(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little") if n else b""


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    """A value of any msgpack type, biased to edges: huge and negative numbers, NaN, long
    strings, length claims past the data, deep nesting, containers of the same."""
    r = rng.random()
    if r < 0.3:
        return rng.choice(EDGE_INTS)
    if r < 0.38:
        return rng.choice([float("nan"), float("inf"), -float("inf"), -0.0, 1e308, 0.5])
    if r < 0.45:
        return rng.choice([None, True, False])
    if r < 0.55:
        return rng.choice(["", "tcp", "shm", "ucx", "auto", "float32", "x" * rng.randrange(1, 3000)])
    if r < 0.65:
        return _bytes(rng, rng.choice([0, 1, 15, 16, 17, 31, 32, 33, 600]))
    if r < 0.7:
        return rng.choice(CLAIMS)
    if r < 0.75:
        return deep(rng.choice([2, 100, 900, 999, 1000, 1001, 3000, 20000]))
    if depth < 3 and r < 0.88:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if depth < 3:
        return {rng.choice(["a", "", "name"]): hostile_value(rng, depth + 1) for _ in range(rng.randrange(0, 3))}
    return rng.randrange(-(2**63), 2**64)


def _perturb(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """``value`` with itself or some of its elements, at any depth, made hostile."""
    if rng.random() < 0.35:
        return hostile_value(rng)
    if isinstance(value, list) and depth < 4:
        return [_perturb(rng, v, depth + 1) for v in value]
    return value


def hostile_body(rng: random.Random, cls: type | None = None) -> bytes:
    """A control message body of type ``cls`` (any, if None) with hostile field values: some
    fields replaced, some missing or extra, now and then a wrong tag or no array at all."""
    cls = cls if cls is not None else rng.choice(MESSAGE_TYPES)
    tag, *values = _SEEDS[cls]
    values = [_perturb(rng, v) for v in values]
    r = rng.random()
    if r < 0.1 and values:
        values = values[: rng.randrange(len(values))]
    elif r < 0.2:
        values += [hostile_value(rng) for _ in range(rng.randrange(1, 3))]
    elif r < 0.25:
        tag = hostile_value(rng)
    elif r < 0.28:
        return msgspec.msgpack.encode(hostile_value(rng))
    return msgspec.msgpack.encode([tag, *values])


def hostile_blob(rng: random.Random, valid: Any) -> bytes:
    """A plane's blob (offer, answer, attach detail) made from ``valid`` with hostile contents,
    or now and then bytes that are no msgpack at all."""
    if rng.random() < 0.1:
        return _bytes(rng, rng.randrange(0, 64))
    return msgspec.msgpack.encode(_perturb(rng, msgspec.msgpack.decode(encode_blob(valid))))


def hostile_attach_detail(rng: random.Random) -> bytes:
    """An Attach body, valid but for the shm plane's detail blob in it."""
    detail = hostile_blob(rng, AttachDetail(True, [os.getpid(), 3, bytes(16), 1 << 16], [1 << 20, bytes(16)]))
    return msgspec.msgpack.encode(_wire.Attach(PV, 1, bytes(32), detail))


def mutate(rng: random.Random, data: bytes) -> bytes:
    """``data`` with a few random edits: flipped bytes, inserts, cuts, edge values written over."""
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op, at = rng.randrange(6), rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[at:at] = _bytes(rng, rng.randrange(1, 9))
        elif op == 2:
            del b[at : at + rng.randrange(1, 9)]
        elif op == 3:
            del b[at:]
        elif op == 4:
            b[at : at + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x00\x80", b"\xdd\xff\xff\xff"])
        else:
            b[at:at] = b[at : at + rng.randrange(1, 32)]
    return bytes(b)


def framed(body: bytes) -> bytes:
    return _wire.LENGTH.pack(len(body)) + body


# What each stage of a connection expects (the rest is refused at once, but tried too).
PREAUTH_TYPES = (_wire.Login, _wire.Attach, _wire.OpenStream)
HELLO_TYPES = (_wire.Hello,)
SESSION_TYPES = (_wire.Sync, _wire.Propose, _wire.Returned, _wire.Got, _wire.Subscribe, _wire.Bye, _wire.Heartbeat,
                 _wire.RelayAt, _wire.Relayed, _wire.BroadcastJoined)  # fmt: skip
RELAY_TYPES = (_wire.RelayOpen,)  # what an actor's relay listener expects (weights/relay.py)


def hostile_stream(rng: random.Random, types: tuple[type, ...] = ()) -> bytes:
    """Bytes for a fresh connection: noise, a length prefix that lies, or framed messages
    (valid, hostile or mutated; mostly of ``types`` where given), any number of them."""
    r = rng.random()
    if r < 0.15:
        return _bytes(rng, rng.randrange(0, 1200))
    if r < 0.25:
        return _wire.LENGTH.pack(rng.choice([0, 513, 2**31, 2**32 - 1])) + _bytes(rng, rng.randrange(0, 64))
    out = b""
    for _ in range(rng.randrange(1, 4)):
        body = hostile_body(rng, rng.choice(types) if types and rng.random() < 0.7 else None)
        if rng.random() < 0.3:
            body = mutate(rng, body)
        out += framed(body)
    return mutate(rng, out) if rng.random() < 0.2 else out


def measure(fn: Any, *args: Any) -> tuple[Any, BaseException | None, int, float]:
    """``fn(*args)``: its result or exception, its tracemalloc peak (bytes) and its seconds."""
    tracemalloc.start()
    started = time.perf_counter()
    result, error = None, None
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed back to the caller
        error = exc
    took = time.perf_counter() - started
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, error, top, took


def bounded(fn: Any, *args: Any, peak: int, seconds: float) -> Any:
    """``fn(*args)``, with its tracemalloc peak and its time held to the bounds."""
    result, error, top, took = measure(fn, *args)
    name = getattr(fn, "__name__", fn)
    if top > peak:
        raise Finding(f"{name}: allocated {top} bytes at peak (bound {peak})")
    if took > seconds:
        raise Finding(f"{name}: took {took:.2f}s (bound {seconds}s)")
    if error is not None:
        raise error
    return result


def outcome(exc: BaseException | None) -> str:
    """The name of a typed outcome; anything untyped is a :class:`Finding`."""
    if exc is None:
        return "accepted"
    if isinstance(exc, ALLOWED):
        return type(exc).__name__
    raise Finding(f"untyped {type(exc).__name__}: {exc}") from exc


class _Silent:
    """A session's control connection where the test does not listen."""

    closed = False

    def send(self, msg: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Lab:
    """A learner's server (never listening: connections are handed to its stages directly)
    on an event loop of its own, with a token, and a loopback listener for socket pairs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.config = Config(buffer_bytes=1 << 20, handshake_timeout=2.0, max_frame_bytes=1 << 20)
        self.server = LearnerServer("127.0.0.1", 0, token=TOKEN, transport="tcp", config=self.config, loop=self.loop)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._ids = itertools.count(1000)

    def close(self) -> None:
        for session in list(self.server.sessions.values()):
            session.close("fuzzing done", lost=False)
        self.loop.run_until_complete(self.server.stop())
        self.loop.close()
        self._listener.close()

    # --- plumbing ---------------------------------------------------------------------------------
    def _pair(self) -> tuple[socket.socket, ControlConnection]:
        ours = socket.create_connection(self._listener.getsockname())
        theirs, _ = self._listener.accept()
        ours.setblocking(False)
        return ours, ControlConnection(theirs, self.loop, "fuzz")

    async def _read(self, sock: socket.socket) -> Any:
        async def exact(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                got = await self.loop.sock_recv(sock, n - len(buf))
                if not got:
                    raise EOFError
                buf += got
            return buf

        (n,) = _wire.LENGTH.unpack(await exact(_wire.LENGTH.size))
        return _wire.decode(await exact(n))

    async def _handshake(self, raw: bytes, login: bool) -> str:
        ours, conn = self._pair()
        task = self.loop.create_task(self.server._handshake(conn))
        try:
            challenge = await self._read(ours)
            if login:  # a real login first: ``raw`` comes after authentication
                nonce = _auth.new_nonce()
                mac = _auth.actor_proof(TOKEN, challenge.nonce, nonce)
                await self.loop.sock_sendall(ours, framed(msgspec.msgpack.encode(_wire.Login(PV, nonce, mac))))
                assert isinstance(await self._read(ours), _wire.Proof)
            await self.loop.sock_sendall(ours, raw)
            ours.shutdown(socket.SHUT_WR)  # nothing more comes: the learner must not wait for more
            try:
                async with asyncio.timeout(5):
                    result = await task
            except TimeoutError as exc:
                raise Finding("the handshake waited on a connection that had said all it would") from exc
            except Exception as exc:  # noqa: BLE001 - classified
                return outcome(exc)
            if result.session is not None:
                result.session.close("fuzzing", lost=False)
            if result.kind in (Kind.SESSION, Kind.STATS, Kind.STREAM):  # stats: answered by the caller's run
                return result.kind.value
            return "attached"
        finally:
            task.cancel()
            conn.close()
            ours.close()

    # --- stages -----------------------------------------------------------------------------------
    def preauth(self, raw: bytes) -> str:
        """``raw`` as the first bytes of a connection, before any authentication."""
        return self.loop.run_until_complete(self._handshake(raw, login=False))

    def authenticated(self, raw: bytes) -> str:
        """``raw`` right after a valid login, where the learner expects Hello."""
        return self.loop.run_until_complete(self._handshake(raw, login=True))

    def session(self, raw: bytes) -> str:
        """``raw`` on the control connection of an open session (after Hello)."""
        return self.loop.run_until_complete(self._session(raw))

    async def _session(self, raw: bytes) -> str:
        ours, conn = self._pair()
        hello = _wire.Hello(7, 0, "0", "tcp", False, "h", 1)
        session = LearnerSession(self.server, next(self._ids), conn, hello, 7, "tcp", "fuzz", bytes(32))
        self.server.sessions[session.id] = session
        try:
            await self.loop.sock_sendall(ours, raw)
            ours.shutdown(socket.SHUT_WR)
            try:
                async with asyncio.timeout(5):
                    await session.serve()
            except TimeoutError as exc:
                raise Finding("a session waited on a connection that had said all it would") from exc
            except Exception as exc:  # noqa: BLE001 - classified
                return outcome(exc)
            return "closed"
        finally:
            session.close("fuzzing", lost=False)
            ours.close()

    def attach(self, body: bytes) -> str:
        """``body`` as the Attach of an shm session's data connection, its session and proof
        made valid: what an authenticated actor can make the learner do with the other fields."""
        try:
            msg = _wire.decode(body)
        except ProtocolError:
            return "ProtocolError"
        if not isinstance(msg, _wire.Attach):
            return "not an Attach"
        ring, _ = shm.ShmRing.create(1 << 16)
        hello = _wire.Hello(7, 0, "0", "shm", False, hostname(), os.getpid(), {"shm": b""})
        session = LearnerSession(self.server, next(self._ids), _Silent(), hello, 7, "shm", "fuzz", os.urandom(32))
        session.opening = ShmOpening(ShmPlane, "fuzz", ring=ring)
        nonce = _auth.new_nonce()
        msg = msgspec.structs.replace(msg, session=session.id, mac=_auth.data_proof(session.key, nonce, session.id))
        ours, conn = self._pair()
        try:
            attach_data_connection({session.id: session}, conn, msg, nonce)
            return "attached (" + session.transport_reason.split("; ", 1)[-1] + ")"
        except Exception as exc:  # noqa: BLE001 - classified
            return outcome(exc)
        finally:
            session.close("fuzzing", lost=False)
            conn.close()
            ours.close()

    @staticmethod
    def header(raw: bytes) -> str:
        """``raw`` as a data frame's header, validated by a session (frames of up to 50 steps):
        accepted within every limit, or refused with nothing reserved."""
        session, ring = make_session(credit=50)
        try:
            views = session.begin(raw)
        except ProtocolError:
            if ring.used or session.flow.credit != 50:
                raise Finding("a refused header reserved ring space or credit") from None
            return "ProtocolError"
        h = FrameHeader.unpack(raw)
        if (h.schema_id, h.actor_id, h.incarnation) != (1, 7, 11) or not 0 < h.n_steps <= 50:
            raise Finding(f"accepted a header outside the session's limits: {h}")
        if sum(len(v) for v in views) != h.payload_bytes or h.payload_bytes != h.n_steps * SCHEMA.step_bytes:
            raise Finding(f"accepted a header whose payload does not add up: {h}")
        return "accepted"

    @staticmethod
    def records(raw: bytes) -> str:
        """``raw`` as the records of an shm data connection, parsed to the end."""
        a, b = socket.socketpair()
        with a, b:
            a.sendall(raw)
            a.shutdown(socket.SHUT_WR)
            reader = shm_records.Records(b)
            try:
                for _ in range(10_000):
                    reader.next()
            except (EOFError, ProtocolError) as exc:
                return type(exc).__name__
            raise Finding("10000 records from fewer bytes")


def hostile_records(rng: random.Random) -> bytes:
    """Records of the shm data connection: known kinds with edge counters, headers and extents."""
    out = b""
    for _ in range(rng.randrange(1, 5)):
        kind = rng.choice([shm.WRITTEN, shm.RING_FRAME, shm.ARENA_FRAME, shm.DIRECT_FRAME, b"Z"])
        out += kind
        if kind == shm.WRITTEN:
            out += shm.COUNTER.pack(rng.choice([0, 1, 2**63, 2**64 - 1]))
        elif kind != b"Z":
            out += FRAME_HEADER.pack(b"RLNK", PV, 0, 1, 1, 7, 0, 0, 0, 16, 0) if rng.random() < 0.5 else _bytes(
                rng, FRAME_HEADER_BYTES)  # fmt: skip
            if kind != shm.RING_FRAME:
                n = rng.choice([0, 1, 2, shm_records.MAX_EXTENTS, shm_records.MAX_EXTENTS + 1, 2**32, 2**64 - 1])
                out += shm.COUNTER.pack(n) + _bytes(rng, 16 * min(n, 3))
    return mutate(rng, out) if rng.random() < 0.3 else out


def hostile_header(rng: random.Random) -> bytes:
    """A data frame header near the test session's limits, or noise."""
    if rng.random() < 0.2:
        return _bytes(rng, rng.choice([0, 1, FRAME_HEADER_BYTES - 1, FRAME_HEADER_BYTES, FRAME_HEADER_BYTES + 1]))
    n = rng.choice([0, 1, 2, 50, 51, 2**31, 2**32 - 1])
    fields = [b"RLNK", PV, 0, 1, n, 7, 11, 0, 0, n * 17, 0]
    for i in rng.sample(range(1, len(fields)), rng.randrange(0, 3)):
        fields[i] = rng.choice([0, 1, 2**16 - 1]) if i <= 2 else rng.choice([0, 2**32 - 1] if i <= 4 else EDGE_INTS[:17])
    try:
        return FRAME_HEADER.pack(*fields)
    except Exception:  # noqa: BLE001 - a value that field cannot hold: noise instead
        return _bytes(rng, FRAME_HEADER_BYTES)

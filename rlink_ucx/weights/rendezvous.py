"""The fan-out group's rendezvous store, relayed over the authenticated control channel.

gloo and NCCL find each other through a ``torch.distributed.Store`` (gloo: every rank's pair
address; NCCL: the unique id). A ``TCPStore`` for that would be one more listening socket with
no authentication of its own: whoever reaches it can list, read and write the keys. Here there
is none. The keys live in the learner's memory (:class:`KeyValue`); the learner's own rank uses
it directly, and each actor's rank reaches it through :class:`RemoteStore`, whose operations
travel as ``StoreRequest``/``StoreReply`` messages on that actor's authenticated control
connection. The learner answers only members of the current group, about that group's keys,
within fixed size caps.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError, RLinkError
from ..errors import TimeoutError as RLinkTimeout
from ..wire import messages as _wire

__all__ = ["KeyValue", "LocalStore", "RemoteStore", "answer", "relay_store"]

MAX_KEY = 512
MAX_VALUE = 1 << 16  # gloo's address records are ~200 bytes, NCCL's unique id 128
MAX_KEYS_PER_REQUEST = 64
MAX_TOTAL = 16 << 20  # bytes held for one group


class KeyValue:
    """The keys of the current group (thread-safe): written by the learner's rank on the
    fan-out thread and by actors' requests on the I/O loop."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._watchers: list[tuple[list[str], Callable[[bool], None]]] = []
        self.generation = 0
        self.members: frozenset[int] = frozenset()  # session ids allowed to use the store
        self.max_keys = 0

    def reset(self, generation: int, members: set[int] | frozenset[int]) -> None:
        """Forget every key and start ``generation`` for ``members`` (0, (): no group)."""
        with self._cv:
            watchers, self._watchers = self._watchers, []
            self._data.clear()
            self._bytes = 0
            self.generation, self.members = generation, frozenset(members)
            self.max_keys = 64 + 8 * (len(members) + 1)
            self._cv.notify_all()
        for _, done in watchers:
            done(False)

    # --- operations (any thread; never block but ``wait``) -------------------------------------
    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            old = self._data.get(key)
            grow = len(value) - (len(old) if old is not None else 0)
            if (old is None and len(self._data) >= self.max_keys) or self._bytes + grow > MAX_TOTAL:
                raise ProtocolError(f"rendezvous store full ({self.max_keys} keys, {MAX_TOTAL} bytes)")
            self._bytes += grow
            self._data[key] = bytes(value)
            ready = [w for w in self._watchers if all(k in self._data for k in w[0])]
            self._watchers = [w for w in self._watchers if w not in ready]
            self._cv.notify_all()
        for _, done in ready:
            done(True)

    def get(self, key: str) -> bytes | None:
        with self._cv:
            return self._data.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._cv:
            current = int(self._data.get(key, b"0") or b"0")
        value = current + amount
        self.set(key, str(value).encode())
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cv:
            current = self._data.get(key)
        if (current is None and not expected) or current == expected:
            self.set(key, desired)
            return desired
        return current if current is not None else expected

    def delete(self, key: str) -> bool:
        with self._cv:
            value = self._data.pop(key, None)
            if value is not None:
                self._bytes -= len(value)
            return value is not None

    def check(self, keys: list[str]) -> bool:
        with self._cv:
            return all(k in self._data for k in keys)

    def count(self) -> int:
        with self._cv:
            return len(self._data)

    def wait(self, keys: list[str], timeout: float, gone: Callable[[], str | None] = lambda: None) -> None:
        """Block until every key exists (the learner's own rank), or ``timeout`` passes, or
        ``gone()`` names a reason to stop waiting (checked every 0.2 s)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RLinkTimeout(f"rendezvous keys {keys[:4]} not set within {timeout:.3g}s")
                why = gone()
                if why is not None:
                    raise RLinkError(f"rendezvous abandoned: {why}")
                self._cv.wait(min(left, 0.2))

    def when_set(self, keys: list[str], done: Callable[[bool], None], *, limit: int) -> None:
        """Call ``done(True)`` once every key exists (at once if they do; any thread), or
        ``done(False)`` if the group is reset first; at most ``limit`` watchers in all."""
        with self._cv:
            if not all(k in self._data for k in keys):
                if len(self._watchers) >= limit:
                    raise ProtocolError(f"too many rendezvous waits ({limit})")
                self._watchers.append((list(keys), done))
                return
        done(True)

    def cancel(self, done: Callable[[bool], None]) -> bool:
        """Drop the watcher ``done`` (it timed out); False if it already ran."""
        with self._cv:
            before = len(self._watchers)
            self._watchers = [w for w in self._watchers if w[1] is not done]
            return len(self._watchers) < before


def check_request(msg: _wire.StoreRequest) -> None:
    """Refuse a request over the caps before touching the store."""
    if msg.op not in _OPS:
        raise ProtocolError(f"rendezvous operation {msg.op[:40]!r} is not supported")
    if not 0 < len(msg.keys) <= MAX_KEYS_PER_REQUEST or len(msg.values) > len(msg.keys):
        raise ProtocolError("rendezvous request with a bad number of keys")
    if any(len(k) > MAX_KEY for k in msg.keys) or any(len(v) > MAX_VALUE for v in msg.values):
        raise ProtocolError(f"rendezvous key or value over its cap ({MAX_KEY} / {MAX_VALUE} bytes)")
    if not 0 <= msg.timeout <= 3600:
        raise ProtocolError("rendezvous wait with a bad timeout")


_OPS = {"set", "get", "add", "check", "compare_set", "delete", "count"}


def answer(kv: KeyValue, session: int, msg: _wire.StoreRequest, reply: Callable[[Any], None],
           loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
    """Serve one actor's request on the I/O loop; ``reply`` sends on its control connection.
    A request over the caps raises ProtocolError (its session ends: rlink never sends one)."""
    check_request(msg)

    def ok(values: list[bytes] | None = None, number: int = 0) -> None:
        reply(_wire.StoreReply(msg.rid, True, values or [], number, ""))

    def refuse(why: str) -> None:
        reply(_wire.StoreReply(msg.rid, False, [], 0, why[:300]))

    if msg.generation != kv.generation or session not in kv.members:
        return refuse(f"this session is not a member of fan-out group {msg.generation}")
    keys, values = list(msg.keys), list(msg.values)
    try:
        if msg.op == "get":
            return _answer_get(kv, keys, msg.timeout, ok, refuse, loop)
        if msg.op == "set" and len(values) == len(keys):
            for k, v in zip(keys, values):
                kv.set(k, v)
            return ok()
        if msg.op == "add":
            return ok(number=kv.add(keys[0], msg.number))
        if msg.op == "check":
            return ok(number=int(kv.check(keys)))
        if msg.op == "compare_set" and len(values) == 2:
            return ok([kv.compare_set(keys[0], values[0], values[1])])
        if msg.op == "delete":
            return ok(number=int(kv.delete(keys[0])))
        if msg.op == "count":
            return ok(number=kv.count())
        refuse(f"malformed rendezvous {msg.op}")
    except (ProtocolError, ValueError) as exc:
        refuse(str(exc))


def _answer_get(kv: KeyValue, keys: list[str], timeout: float, ok: Callable[..., None], refuse: Callable[[str], None],
                loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
    """Answer once every key is set (by any rank), or refuse when ``timeout`` passes first."""
    timer: list[asyncio.TimerHandle] = []

    def finish(present: bool) -> None:  # on the loop
        for t in timer:
            t.cancel()
        got = [kv.get(k) for k in keys]
        if present and all(v is not None for v in got):
            ok(got)
        else:
            refuse("the fan-out group was dropped")

    def done(present: bool) -> None:  # any thread: the learner's rank sets keys on its own
        loop.call_soon_threadsafe(finish, present)

    def expire() -> None:
        if kv.cancel(done):
            refuse(f"rendezvous keys not set within {timeout:.3g}s")

    kv.when_set(keys, done, limit=kv.max_keys)
    timer.append(loop.call_later(timeout, expire))


# --- the actor's side -----------------------------------------------------------------------
class RemoteStore:
    """The store as an actor sees it: each operation is a request on the control connection
    (``send`` queues a message from any thread), answered by the learner."""

    def __init__(self, send: Callable[[Any], None], generation: int, timeout: float):
        self._send = send
        self.generation = generation
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, list[Any]] = {}  # request id -> [event, reply]
        self._cache: dict[str, bytes] = {}  # values a wait fetched: gloo's get follows its wait
        self._error: RLinkError | None = None

    def deliver(self, reply: _wire.StoreReply) -> None:
        """A reply arrived (the I/O loop)."""
        with self._lock:
            slot = self._pending.get(reply.rid)
        if slot is not None:
            slot[1] = reply
            slot[0].set()

    def fail(self, exc: RLinkError) -> None:
        """The connection is gone: every waiting operation raises ``exc``."""
        with self._lock:
            self._error = exc
            slots = list(self._pending.values())
        for slot in slots:
            slot[0].set()

    def call(self, op: str, keys: list[str], values: list[bytes] = (), number: int = 0,  # type: ignore[assignment]
             timeout: float | None = None) -> _wire.StoreReply:  # fmt: skip
        wait = self.timeout if timeout is None else timeout
        rid = next(self._ids)
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            if self._error is not None:
                raise self._error
            self._pending[rid] = slot
        try:
            self._send(_wire.StoreRequest(rid, self.generation, op, list(keys), list(values), number, wait))
            # The learner answers a wait when it ends either way; the margin covers the trip.
            if not slot[0].wait(wait + 5.0):
                raise RLinkTimeout(f"rendezvous {op} of {keys[:2]} not answered within {wait:.3g}s")
        finally:
            with self._lock:
                self._pending.pop(rid, None)
        reply: _wire.StoreReply | None = slot[1]
        if reply is None:
            raise self._error or RLinkError("rendezvous request lost")
        if not reply.ok:
            raise RLinkError(f"rendezvous {op} refused by the learner: {reply.error}")
        return reply

    # --- the operations torch.distributed calls -----------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self.call("set", [key], [bytes(value)])

    def get(self, key: str) -> bytes:
        cached = self._cache.pop(key, None)
        return cached if cached is not None else self.call("get", [key]).values[0]

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        values = self.call("get", list(keys), timeout=min(self.timeout, timeout or self.timeout)).values
        self._cache.update(zip(keys, values))

    def add(self, key: str, amount: int) -> int:
        return self.call("add", [key], number=amount).number

    def check(self, keys: list[str]) -> bool:
        return bool(self.call("check", list(keys)).number)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.call("compare_set", [key], [bytes(expected), bytes(desired)]).values[0]

    def delete(self, key: str) -> bool:
        return bool(self.call("delete", [key]).number)

    def count(self) -> int:
        return self.call("count", ["-"]).number


class LocalStore:
    """The learner rank's view of :class:`KeyValue` (blocking gets, like every store). ``gone``
    names a reason to stop waiting (a member whose session ended will never set its keys)."""

    def __init__(self, kv: KeyValue, timeout: float, gone: Callable[[], str | None] = lambda: None):
        self.kv, self.timeout, self.gone = kv, timeout, gone

    def set(self, key: str, value: bytes) -> None:
        self.kv.set(key, bytes(value))

    def get(self, key: str) -> bytes:
        self.kv.wait([key], self.timeout, self.gone)
        value = self.kv.get(key)
        if value is None:
            raise RLinkError(f"rendezvous key {key!r} vanished (the group was dropped)")
        return value

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self.kv.wait(list(keys), min(self.timeout, timeout or self.timeout), self.gone)

    def add(self, key: str, amount: int) -> int:
        return self.kv.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.kv.check(list(keys))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.kv.compare_set(key, bytes(expected), bytes(desired))

    def delete(self, key: str) -> bool:
        return self.kv.delete(key)

    def count(self) -> int:
        return self.kv.count()


def relay_store(backend: RemoteStore | LocalStore) -> Any:
    """A ``torch.distributed.Store`` whose operations go to ``backend``. Keep a reference as
    long as the process group lives: torch holds only the C++ side of a Python store."""
    store = _store_class()(backend)
    # gloo waits as long as its store's timeout, 300 s unless set: the group's own bounds it.
    store.set_timeout(datetime.timedelta(seconds=backend.timeout))
    return store


@functools.cache
def _store_class() -> type:
    import torch.distributed as dist

    class RelayStore(dist.Store):  # type: ignore[misc,name-defined]
        def __init__(self, backend: RemoteStore | LocalStore):
            super().__init__()
            self.backend = backend

        def set(self, key: str, value: Any) -> None:
            self.backend.set(key, bytes(value))

        def get(self, key: str) -> bytes:
            return self.backend.get(key)

        def add(self, key: str, value: int) -> int:
            return self.backend.add(key, int(value))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return self.backend.compare_set(key, bytes(expected), bytes(desired))

        def delete_key(self, key: str) -> bool:
            return self.backend.delete(key)

        def num_keys(self) -> int:
            return self.backend.count()

        def check(self, keys: list[str]) -> bool:
            return self.backend.check(list(keys))

        def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
            self.backend.wait(list(keys), None if timeout is None else timeout.total_seconds())

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self.wait(keys)
            return [self.get(k) for k in keys]

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            for k, v in zip(keys, values):
                self.set(k, v)

        def clone(self) -> Any:
            return self  # torch keeps only the C++ side of a Python store: never a new one

    return RelayStore

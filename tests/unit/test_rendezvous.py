"""The fan-out group's rendezvous store, relayed over control messages (weights/rendezvous.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rlink_ucx import ProtocolError
from rlink_ucx.weights.group import new_group
from rlink_ucx.weights.rendezvous import MAX_VALUE, KeyValue, LocalStore, RemoteStore, answer, relay_store
from rlink_ucx.wire import messages as _wire

pytestmark = pytest.mark.timeout(60)


class Loop:
    """An asyncio loop on a thread of its own (the learner's I/O loop, here)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn, *args):
        done = threading.Event()
        out: list = []

        def run():
            try:
                out.append(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                out.append(exc)
            done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(10)
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def loop():
    lp = Loop()
    yield lp
    lp.close()


def request(op, keys, values=(), number=0, timeout=5.0, generation=1, rid=1):
    return _wire.StoreRequest(rid, generation, op, list(keys), list(values), number, timeout)


def ask(loop: Loop, kv: KeyValue, session: int, msg, wait: float = 5.0):
    replies: list = []
    got = threading.Event()

    def reply(r):
        replies.append(r)
        got.set()

    loop.call(answer, kv, session, msg, reply, loop.loop)
    got.wait(wait)
    return replies[0] if replies else None


def test_members_set_and_get_and_a_get_waits_for_the_key(loop):
    kv = KeyValue()
    kv.reset(1, {10, 11})
    assert ask(loop, kv, 10, request("set", ["rlink/1/0/1"], [b"addr-1"])).ok
    got = ask(loop, kv, 11, request("get", ["rlink/1/0/1"]))
    assert got.ok and got.values == [b"addr-1"]
    # A get for a key nobody set yet is answered once the learner's own rank sets it.
    threading.Timer(0.3, LocalStore(kv, 5).set, args=("rlink/1/0/0", b"addr-0")).start()
    started = time.monotonic()
    got = ask(loop, kv, 11, request("get", ["rlink/1/0/0", "rlink/1/0/1"]))
    assert got.ok and got.values == [b"addr-0", b"addr-1"] and time.monotonic() - started >= 0.25
    assert ask(loop, kv, 10, request("add", ["n"], number=5)).number == 5
    assert ask(loop, kv, 10, request("check", ["n", "rlink/1/0/0"])).number == 1
    assert ask(loop, kv, 10, request("count", ["-"])).number == 3


def test_strangers_other_groups_and_oversized_requests_are_refused(loop):
    kv = KeyValue()
    kv.reset(2, {10})
    refused = ask(loop, kv, 99, request("set", ["k"], [b"v"], generation=2))
    assert not refused.ok and "not a member" in refused.error and kv.get("k") is None
    refused = ask(loop, kv, 10, request("set", ["k"], [b"v"], generation=1))
    assert not refused.ok and kv.get("k") is None
    with pytest.raises(ProtocolError, match="cap"):
        ask(loop, kv, 10, request("set", ["k"], [b"v" * (MAX_VALUE + 1)], generation=2))
    with pytest.raises(ProtocolError, match="not supported"):
        ask(loop, kv, 10, request("list_keys", ["k"], generation=2))
    for i in range(kv.max_keys):
        assert ask(loop, kv, 10, request("set", [f"k{i}"], [b"v"], generation=2)).ok
    full = ask(loop, kv, 10, request("set", ["one-more"], [b"v"], generation=2))
    assert not full.ok and "full" in full.error and kv.count() == kv.max_keys


def test_a_get_times_out_or_fails_when_the_group_is_dropped(loop):
    kv = KeyValue()
    kv.reset(1, {10})
    late = ask(loop, kv, 10, request("get", ["never"], timeout=0.2))
    assert late is not None and not late.ok and "within" in late.error
    threading.Timer(0.2, kv.reset, args=(2, {10})).start()
    dropped = ask(loop, kv, 10, request("get", ["never"], timeout=10))
    assert dropped is not None and not dropped.ok and "dropped" in dropped.error


def test_a_gloo_group_meets_through_the_relay_and_broadcasts(loop):
    """Rank 0 uses the learner's store directly; ranks 1 and 2 only through requests answered
    on the loop, as actors do over their control connections."""
    kv = KeyValue()
    world = 3
    kv.reset(1, {1, 2})
    remotes = {}

    def sender(session):
        def send(msg):
            loop.loop.call_soon_threadsafe(answer, kv, session, msg, lambda r: remotes[session].deliver(r), loop.loop)

        return send

    groups, stores, errors = [None] * world, [], []

    def join(rank):
        try:
            if rank == 0:
                backend = LocalStore(kv, 20)
            else:
                backend = remotes[rank] = RemoteStore(sender(rank), 1, 20)
            store = relay_store(backend)
            stores.append(store)
            groups[rank] = new_group(store, "rlink/1/", rank, world, backend="gloo", hostname="127.0.0.1", timeout=20)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not errors and all(groups), errors
    tensors = [torch.full((5,), 7.0) if r == 0 else torch.zeros(5) for r in range(world)]
    works = [groups[r].broadcast(tensors[r], 0) for r in range(world)]
    for w in works:
        w.wait()
    assert all(t.tolist() == [7.0] * 5 for t in tensors)
    assert kv.count() == world  # one address record per rank, nothing else


def test_the_learner_stops_waiting_once_a_member_is_gone():
    """A member whose session ended will never set its key: the learner's rank gives up at once
    instead of at the group's timeout."""
    from rlink_ucx import RLinkError

    kv = KeyValue()
    kv.reset(1, {10, 11})
    left: list[int] = []
    store = LocalStore(kv, 30, lambda: f"member {left} left" if left else None)
    threading.Timer(0.3, left.append, args=(11,)).start()
    started = time.monotonic()
    with pytest.raises(RLinkError, match="left"):
        store.get("rlink/1/0/2")
    assert time.monotonic() - started < 2

"""How each actor gets each version (``weights.route.delivery``), and that the fan-out and the
weights streams both follow it. No sockets: the publisher's control messages are recorded."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rlink_ucx.transport.session_state import SessionState
from rlink_ucx.weights import publisher as publisher_mod
from rlink_ucx.weights.chain import RELAY_MIN_BYTES
from rlink_ucx.weights.hosts import note_refusal, note_served, peers_of
from rlink_ucx.weights.membership import Membership
from rlink_ucx.weights.relay import stall_timeout
from rlink_ucx.weights.route import Route, delivery
from rlink_ucx.weights.snapshot import BufferPool, snapshot
from rlink_ucx.weights.streams import _Stream
from rlink_ucx.wire import messages as _wire

IN_SHARED_MEMORY = SimpleNamespace(shared=[1, 3, b"n" * 16, 64])
OUTSIDE = SimpleNamespace(shared=None)  # a CUDA version: not in shared memory
KEY = b"k" * 32

CASES = [  # (member, version, route)
    (Membership(subscribed=True), None, Route.STREAM),
    (Membership(subscribed=True), IN_SHARED_MEMORY, Route.STREAM),
    (Membership(subscribed=True), OUTSIDE, Route.STREAM),
    (Membership(subscribed=True, shared=True, key=KEY, sent=4, acked=4), IN_SHARED_MEMORY, Route.SHARED),
    (Membership(subscribed=True, shared=True, key=KEY, sent=4, acked=5), IN_SHARED_MEMORY, Route.SHARED),
    (Membership(subscribed=True, shared=True, key=KEY), None, Route.SHARED),
    (Membership(subscribed=True, shared=True, key=KEY, sent=4, acked=4), OUTSIDE, Route.STREAM),
    (Membership(subscribed=True, shared=True, key=KEY, sent=5, acked=4), IN_SHARED_MEMORY, Route.CATCH_UP),
    (Membership(subscribed=True, shared=True, key=KEY, sent=5, acked=4), None, Route.CATCH_UP),
    (Membership(subscribed=True, shared=True, key=None), IN_SHARED_MEMORY, Route.CATCH_UP),
    (Membership(subscribed=True, shared=True, key=KEY, sent=5, acked=4), OUTSIDE, Route.STREAM),
    # off the learner's host, sharing copies with the host's other actors (weights/hosts.py)
    (Membership(subscribed=True, peers=True, streamer=True, key=KEY, sent=4, acked=4), IN_SHARED_MEMORY, Route.STREAM),
    (Membership(subscribed=True, peers=True, streamer=True, key=KEY, sent=5, acked=4), OUTSIDE, Route.STREAM),
    (Membership(subscribed=True, peers=True, key=KEY, sent=4, acked=4), IN_SHARED_MEMORY, Route.FROM_PEER),
    (Membership(subscribed=True, peers=True, key=KEY, sent=4, acked=4), OUTSIDE, Route.FROM_PEER),
    (Membership(subscribed=True, peers=True, key=KEY, sent=4, acked=4), None, Route.FROM_PEER),
    (Membership(subscribed=True, peers=True, key=KEY, sent=5, acked=4), IN_SHARED_MEMORY, Route.CATCH_UP),
]


@pytest.mark.parametrize(("member", "version", "route"), CASES)
def test_delivery_answers(member, version, route):
    assert delivery(member, version) is route


def test_a_subscription_key_is_never_printed():
    assert "kkkk" not in repr(Membership(shared=True, key=KEY))


class Recorder:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def session(sid: int, member: Membership) -> Any:
    return SimpleNamespace(id=sid, actor_id=100 + sid, state=SessionState.OPEN, weights=member, control=Recorder())


def sent_types(publisher, sessions) -> dict[int, list[type]]:
    publisher.loop.run_until_complete(asyncio.sleep(0))  # run the sends queued for the loop
    got = {sid: [type(m) for m in s.control.sent] for sid, s in sessions.items()}
    for s in sessions.values():
        s.control.sent.clear()
    return got


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_shared_memory", [True, False], ids=["shared-memory", "private"])
def test_the_fan_out_and_the_streams_follow_delivery(publisher, in_shared_memory):
    snap = snapshot({"w": np.arange(1000, dtype=np.float32)}, 5, 1 << 20, BufferPool(shared=in_shared_memory))
    assert (snap.shared is not None) == in_shared_memory
    members = {  # acked ahead of the version: the fan-out does not wait for confirmations
        1: Membership(subscribed=True, shared=True, key=KEY, sent=4, acked=9),  # caught up
        2: Membership(subscribed=True, shared=True, key=KEY, sent=9, acked=8),  # behind
        3: Membership(subscribed=True, sent=4, acked=9),  # another host
    }
    sessions = {sid: session(sid, m) for sid, m in members.items()}
    publisher.server.sessions.update(sessions)
    routes = {sid: delivery(m, snap) for sid, m in members.items()}
    publisher.latest = snap
    kept = {sid: publisher.streams._keeps(_Stream(s, sock=None, key=b"", sent=4)) for sid, s in sessions.items()}  # type: ignore[arg-type]

    publisher._fan_out(snap)
    publisher.loop.run_until_complete(asyncio.sleep(0))  # run the sends queued for the loop

    got = {sid: [type(m) for m in s.control.sent] for sid, s in sessions.items()}
    expected = (
        {1: Route.SHARED, 2: Route.CATCH_UP, 3: Route.STREAM} if in_shared_memory
        else {1: Route.STREAM, 2: Route.STREAM, 3: Route.STREAM}
    )  # fmt: skip
    assert routes == expected
    for sid, route in routes.items():
        if route is Route.SHARED:
            assert got[sid] == [_wire.Mapped, _wire.WeightsKey, _wire.Seal], got
            assert members[sid].sent == snap.version
        else:  # told of it: it comes on the actor's weights stream
            assert got[sid] == [_wire.Version], got
        assert kept[sid] is (route is Route.STREAM), (sid, route)


@pytest.mark.timeout(30)
def test_an_actor_that_never_confirms_holds_back_no_later_version(publisher):
    """A frozen actor (SIGSTOPped) never confirms a version: the fan-out of the next one starts
    as soon as it is published, not ``weights_timeout`` (30 s) later, and the frozen actor is
    sent the next one on a weights stream of its own (it fell behind shared memory)."""
    members = {sid: Membership(subscribed=True, shared=True, key=KEY) for sid in (1, 2)}
    sessions = {sid: session(sid, m) for sid, m in members.items()}
    publisher.server.sessions.update(sessions)
    publisher.publish({"w": np.zeros(256, np.float32)}, wait=False, timeout=None)
    deadline = time.monotonic() + 5
    while members[1].sent < 1 and time.monotonic() < deadline:  # the first version is mapped
        time.sleep(0.01)
    publisher.on_got(sessions[1], 1)  # actor 1 confirms; actor 2 is frozen
    started = time.monotonic()
    publisher.publish({"w": np.ones(256, np.float32)}, wait=False, timeout=None)
    while members[1].sent < 2 and time.monotonic() - started < 10:
        time.sleep(0.01)
    assert members[1].sent == 2 and time.monotonic() - started < 2, publisher.snapshot_stats()
    publisher.on_got(sessions[1], 2)
    assert publisher.wait(2, timeout=0.5) is False  # actor 2 has not confirmed it: publish(wait=True) says so
    assert publisher._fanned == 2
    publisher.loop.run_until_complete(asyncio.sleep(0))  # run the sends queued for the loop
    got = {sid: [type(m) for m in s.control.sent] for sid, s in sessions.items()}
    if publisher.latest.shared is not None:  # on shared memory: 1 reads it there, 2 catches up by stream
        assert got[1] == [_wire.Mapped, _wire.WeightsKey, _wire.Seal] * 2, got
        assert got[2] == [_wire.Mapped, _wire.WeightsKey, _wire.Seal, _wire.Version], got
    else:
        assert got[1] == got[2] == [_wire.Version, _wire.Version], got
    assert publisher.stats["fanout_failures"] == 0


def peer(host: str, **kw: Any) -> Membership:
    return Membership(subscribed=True, peers=True, host=host, key=KEY, sent=4, acked=4, **kw)


@pytest.mark.timeout(30)
def test_one_copy_per_host_the_streamers_copy_is_mapped_for_its_hosts_peers_and_a_successor_takes_over(publisher):
    snap = snapshot({"w": np.arange(1000, dtype=np.float32)}, 5, 1 << 20, BufferPool())
    publisher.latest = snap
    members = {1: peer("h2", streamer=True), 2: peer("h2"), 3: peer("h2"), 4: peer("h3", streamer=True),
               5: Membership(subscribed=True, shared=True, host="learner", key=KEY, sent=4, acked=4)}
    sessions = {sid: session(sid, m) for sid, m in members.items()}
    publisher.server.sessions.update(sessions)
    where = [4242, 7, b"n" * 16, snap.manifest.total_bytes]

    publisher.on_got(sessions[1], 5, [4242, 7, b"n" * 16, 12])  # a copy of another size: passed on to nobody
    publisher.on_got(sessions[1], 5, "junk")
    assert sent_types(publisher, sessions) == {sid: [] for sid in sessions}
    assert members[1].acked == 5 and members[1].held is None

    publisher.on_got(sessions[1], 5, where)  # the streamer of h2 holds it: h2's peers read it there
    publisher.loop.run_until_complete(asyncio.sleep(0))
    mapped = sessions[2].control.sent[0]
    assert (mapped.where, mapped.manifest.version) == (where, 5)
    assert sent_types(publisher, sessions) == {1: [], 2: [_wire.Mapped, _wire.WeightsKey, _wire.Seal],
                                               3: [_wire.Mapped, _wire.WeightsKey, _wire.Seal], 4: [], 5: []}
    assert (members[2].sent, members[3].sent, members[1].held) == (5, 5, (5, where))
    assert publisher.stats["from_peers"] == 2
    publisher.on_got(sessions[2], 5, where)  # a peer confirms: nobody is left waiting on h2
    assert sent_types(publisher, sessions) == {sid: [] for sid in sessions}
    publisher.server.version = 5  # actor 103 has not confirmed version 5 yet, nor 104 on h3
    assert publisher.snapshot_stats()["hosts"] == {
        "h2": {"actors": [101, 102, 103], "streamer": 101, "refused": [], "lag": 1},
        "h3": {"actors": [104], "streamer": 104, "refused": [], "lag": 1}}

    # h2's streamer ends: the peer with the lowest id takes over; it holds version 5 already
    sessions[1].state = SessionState.CLOSED
    publisher.on_session_end(sessions[1])
    assert (members[1].streamer, members[2].streamer, members[3].streamer) == (False, True, False)
    assert sent_types(publisher, sessions) == {sid: [] for sid in sessions}
    # h3's streamer ends with no peer left: nobody to elect
    sessions[4].state = SessionState.CLOSED
    publisher.on_session_end(sessions[4])
    publisher.on_got(sessions[3], 5, None)
    assert publisher.snapshot_stats()["hosts"] == {"h2": {"actors": [102, 103], "streamer": 102, "refused": [], "lag": 0}}


@pytest.mark.timeout(30)
def test_a_successor_without_the_newest_version_is_told_to_stream_it_and_then_serves_its_peers(publisher):
    snap = snapshot({"w": np.arange(1000, dtype=np.float32)}, 6, 1 << 20, BufferPool())
    publisher.latest = snap
    members = {1: peer("h2", streamer=True), 2: peer("h2"), 3: peer("h2")}
    sessions = {sid: session(sid, m) for sid, m in members.items()}
    publisher.server.sessions.update(sessions)
    sessions[1].state = SessionState.CLOSED  # died before it confirmed version 6
    publisher.on_session_end(sessions[1])
    assert sent_types(publisher, sessions) == {1: [], 2: [_wire.Version], 3: []}
    where = [4243, 9, b"m" * 16, snap.manifest.total_bytes]
    publisher.on_got(sessions[2], 6, where)  # it streamed version 6: its peer reads its copy
    assert sent_types(publisher, sessions) == {1: [], 2: [], 3: [_wire.Mapped, _wire.WeightsKey, _wire.Seal]}
    assert members[3].sent == 6


def test_a_holder_whose_copy_peers_refuse_two_versions_in_a_row_serves_no_more():
    sessions = {sid: session(sid, peer("h2", streamer=sid == 1)) for sid in (1, 2, 3)}
    holder, reader, other = sessions[1], sessions[2], sessions[3]
    for version in (5, 6):  # told to read holder's copy of each, then asked for it by stream
        reader.weights.sent, reader.weights.mapped_from = version, 1
        other.weights.sent, other.weights.mapped_from = version, 1
        assert note_refusal(sessions, reader, version - 1) is (reader if version == 6 else None)
        assert note_refusal(sessions, other, version - 1) is None  # the same version: one strike
    # the lowest-numbered other actor of the host streams for it now
    assert holder.weights.suspect and not holder.weights.streamer and reader.weights.streamer
    assert delivery(holder.weights, None) is Route.STREAM  # it takes versions by stream, serves none
    other.weights.acked = 6  # caught up (by stream): it reads the new streamer's copies
    assert [s.id for s in peers_of(sessions.values(), reader, 7)] == [3]


def test_strikes_start_over_when_a_peer_confirms_a_copy_and_a_caught_up_stream_is_no_strike():
    sessions = {sid: session(sid, peer("h2", streamer=sid == 1)) for sid in (1, 2)}
    holder, reader = sessions[1], sessions[2]
    reader.weights.sent, reader.weights.mapped_from = 5, 1
    assert note_refusal(sessions, reader, 4) is None and holder.weights.strikes == (5,)
    reader.weights.sent, reader.weights.mapped_from = 6, 1
    note_served(sessions, reader, 6)  # version 6 from its copy verified: the strike is forgiven
    assert holder.weights.strikes == () and reader.weights.mapped_from is None
    reader.weights.sent, reader.weights.mapped_from = 7, 1
    assert note_refusal(sessions, reader, 7) is None and holder.weights.strikes == ()  # it has 7: no refusal
    reader.weights.sent, reader.weights.mapped_from = 8, 1
    holder.state = SessionState.CLOSED  # the holder ended: its peers' detour is no strike
    assert note_refusal(sessions, reader, 7) is None and holder.weights.strikes == ()


@pytest.mark.timeout(30)
def test_a_refused_holder_confirming_a_version_serves_it_to_nobody(publisher):
    snap = snapshot({"w": np.arange(1000, dtype=np.float32)}, 5, 1 << 20, BufferPool())
    publisher.latest = snap
    members = {1: peer("h2", suspect=True), 2: peer("h2", streamer=True), 3: peer("h2")}
    sessions = {sid: session(sid, m) for sid, m in members.items()}
    publisher.server.sessions.update(sessions)
    publisher.on_got(sessions[1], 5, [4242, 7, b"n" * 16, snap.manifest.total_bytes])  # before the streamer
    assert sent_types(publisher, sessions) == {1: [], 2: [], 3: []} and members[1].held is None
    publisher.on_got(sessions[2], 5, [4243, 8, b"m" * 16, snap.manifest.total_bytes])
    assert sent_types(publisher, sessions) == {1: [], 2: [], 3: [_wire.Mapped, _wire.WeightsKey, _wire.Seal]}


def without_fan_out(publisher) -> None:
    """``publisher.publish`` starts no fan-out thread: only the messages under test go out."""
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    publisher._thread = done


def one_host_at_version_4(publisher) -> tuple[dict[int, Membership], dict[int, Any]]:
    """Version 4 published; host h2's streamer (1) and two peers hold it; no fan-out thread."""
    publisher.latest = snapshot({"w": np.full(1000, 4, np.float32)}, 4, 1 << 20, BufferPool())
    publisher.server.version = 4
    members = {1: peer("h2", streamer=True), 2: peer("h2"), 3: peer("h2")}
    sessions = {sid: session(sid, m) for sid, m in members.items()}
    publisher.server.sessions.update(sessions)
    without_fan_out(publisher)
    return members, sessions


@pytest.mark.timeout(30)
def test_a_got_that_comes_before_publish_marks_its_version_latest_still_serves_the_hosts_peers(publisher,
                                                                                              monkeypatch):  # fmt: skip
    """A version's Seal goes out as soon as it is sealed, before ``publish`` sets it as ``latest``:
    on a loaded machine the streamer's Got came in between, its host's peers were told nothing,
    and they waited for the next version (a relay test's publish went unconfirmed for 60 s)."""
    members, sessions = one_host_at_version_4(publisher)
    seal, got = publisher_mod.fill, []

    def fill_then_got(snap: Any, srcs: Any) -> None:
        seal(snap, srcs)  # sealed: its Seal is out, the streamer verifies it and confirms
        got.append([4242, 7, b"n" * 16, snap.manifest.total_bytes])
        publisher.on_got(sessions[1], snap.version, got[0])

    monkeypatch.setattr(publisher_mod, "fill", fill_then_got)
    assert publisher.publish({"w": np.full(1000, 5, np.float32)}, wait=False, timeout=None) == 5
    assert sent_types(publisher, sessions) == {1: [], 2: [_wire.Mapped, _wire.WeightsKey, _wire.Seal],
                                               3: [_wire.Mapped, _wire.WeightsKey, _wire.Seal]}  # fmt: skip
    assert (members[2].sent, members[3].sent, members[1].held) == (5, 5, (5, got[0]))


@pytest.mark.timeout(30)
def test_a_streamer_elected_while_a_version_is_being_copied_is_told_of_that_version(publisher, monkeypatch):
    members, sessions = one_host_at_version_4(publisher)
    copy = publisher_mod.fill

    def streamer_ends_then_fill(snap: Any, srcs: Any) -> None:
        sessions[1].state = SessionState.CLOSED  # its fan-out routed 2 and 3 to its copy
        publisher.on_session_end(sessions[1])
        copy(snap, srcs)

    monkeypatch.setattr(publisher_mod, "fill", streamer_ends_then_fill)
    assert publisher.publish({"w": np.full(1000, 5, np.float32)}, wait=False, timeout=None) == 5
    assert members[2].streamer
    publisher.loop.run_until_complete(asyncio.sleep(0))  # run the sends queued for the loop
    told = sessions[2].control.sent
    assert [(type(m), m.version) for m in told] == [(_wire.Version, 5)], told  # it opens a stream for it


@pytest.mark.timeout(30)
def test_a_streamer_stopped_before_it_opened_its_stream_leaves_the_chain(publisher):
    """A host's streamer routed by stream with no stream open is told of each version: that
    counts as sent, so one stopped before it opened its stream (unlinked from its relay a
    moment before its SIGSTOP) is behind, and the chain's stall rule splices it out. Counted
    only by a stream's push, it stayed in the chain and its host behind it took nothing (a
    relay test's rare failure)."""
    snap = snapshot({"w": np.zeros(RELAY_MIN_BYTES // 4, np.float32)}, 5, 1 << 20, BufferPool())
    members = {1: peer("h2", streamer=True, relay=True), 2: peer("h3", streamer=True, relay=True),
               3: peer("h4", streamer=True, relay=True)}  # fmt: skip
    sessions = {sid: session(sid, m) for sid, m in members.items()}
    publisher.server.sessions.update(sessions)
    publisher.latest = snap

    publisher._fan_out(snap)  # nobody has a stream open: each is told of version 5
    relay_then_version = [_wire.RelayServe, _wire.Version]  # h2 and h3 are asked to relay to the next host
    assert sent_types(publisher, sessions) == {1: relay_then_version, 2: relay_then_version, 3: [_wire.Version]}
    assert [m.sent for m in members.values()] == [5, 5, 5] and publisher._chain.order == [1, 2, 3]
    for sid in (1, 3):  # they confirm it; the second is stopped
        publisher.on_got(sessions[sid], 5)
    stall, now = stall_timeout(publisher.config), time.monotonic()
    assert [s.id for s in publisher._chain._plan(sessions.values(), snap.manifest.total_bytes, now)] == [1, 2, 3]
    later = publisher._chain._plan(sessions.values(), snap.manifest.total_bytes, now + stall + 1)
    assert [s.id for s in later] == [1, 3]  # spliced out: h4 takes the next version from h2

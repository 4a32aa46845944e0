"""The UCX plane against peers that did not authenticate: what they send is thrown away (the
learner's memory does not grow with it) while a live actor loses nothing, and UCX listens only
on the interfaces of the control channel."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
from typing import Any

import pytest

from rlink_ucx import Config, Learner, RLinkDataset
from rlink_ucx.transport import interfaces
from rlink_ucx.transport.ucx import probe as ucx_probe
from tests.conftest import ucx_importable
from tests.integration.hostile import (
    RawActor,
    listening_sockets,
    paced_int_proc,
    ucx_short_header_proc,
    ucx_short_payload_proc,
    ucx_stalled_actor_proc,
    ucx_stranger_proc,
    ucx_unannounced_payload_proc,
)

SPAWN = mp.get_context("spawn")
TOKEN = b"ucx-stranger-test-token-0123456789"
JUNK_BYTES = 200 << 20
JUNK_MESSAGE = 4096  # eager: UCX keeps such a message's bytes until a receive matches it

pytestmark = pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def drain(dataset: RLinkDataset, seen: list[int], until: float) -> None:
    while time.monotonic() < until:
        try:
            seen.extend(dataset.fetch(timeout=0.2)["x"].tolist())
        except TimeoutError:
            pass


@pytest.mark.timeout(240)
def test_200_mib_of_tagged_junk_from_a_stranger_does_not_grow_the_learner_and_a_live_actor_loses_nothing():
    with Learner("127.0.0.1:0", token=TOKEN, transport="ucx") as learner:
        dataset = RLinkDataset(learner, batch_size=100)
        # The stranger knows the learner's worker address (from a session of its own that has
        # ended) but holds no live session, so no tag of any live one.
        raw = RawActor(learner.address, TOKEN)
        worker_address = raw.hello(pid=os.getpid(), transport="ucx", ucx=True).answer
        raw.close()
        assert worker_address
        stop, out = SPAWN.Event(), SPAWN.Queue()
        honest = SPAWN.Process(target=paced_int_proc, args=(learner.address, TOKEN, "ucx", stop, out))
        honest.start()
        seen: list[int] = []
        while len(seen) < 2000:  # warm: the ring and the receive path are in use
            seen.extend(dataset.fetch(timeout=60)["x"].tolist())
        before = rss_bytes()
        sent = SPAWN.Queue()
        stranger = SPAWN.Process(target=ucx_stranger_proc, args=(worker_address, JUNK_BYTES, JUNK_MESSAGE, sent))
        stranger.start()
        messages = None
        while messages is None:
            drain(dataset, seen, time.monotonic() + 0.5)
            if not sent.empty():
                messages = sent.get()
        stranger.join(30)
        drain(dataset, seen, time.monotonic() + 1)  # the learner's thread works through the tail
        grown = rss_bytes() - before
        stop.set()
        n, _, transport = out.get(timeout=60)
        honest.join(30)
        while len(seen) < n:
            seen.extend(dataset.fetch(timeout=30)["x"].tolist())
        print(f"stranger: {messages} messages; learner grew {grown / 2**20:.1f} MiB; honest actor: {n} steps")
        assert transport == "ucx"
        assert messages * JUNK_MESSAGE >= JUNK_BYTES, "the stranger did not get its junk out"
        # Kept by UCX, the junk grew the learner by ~254 MiB. Thrown away, it is a few MiB of
        # UCX's own buffers (and the honest actor's frames in flight).
        assert grown < 48 << 20, f"the learner grew by {grown >> 20} MiB with {JUNK_BYTES >> 20} MiB of junk"
        assert seen == list(range(n)), "the honest actor lost, repeated or reordered steps"
        assert learner._server.planes["ucx"].worker.discarded >= messages


@pytest.mark.timeout(180)
def test_junk_queued_behind_a_stalled_actors_next_header_is_thrown_away_too():
    # The stalled actor's second header waits (kept) at the head of the unexpected queue until
    # its first frame completes; it must not shelter the stranger's junk queued behind it.
    config = Config(frame_timeout=60, heartbeat_timeout=60)
    with Learner("127.0.0.1:0", token=TOKEN, transport="ucx", config=config) as learner:
        stop, out = SPAWN.Event(), SPAWN.Queue()
        stalled = SPAWN.Process(target=ucx_stalled_actor_proc, args=(learner.address, TOKEN, out, stop))
        stalled.start()
        try:
            assert out.get(timeout=60) == "stalled"
            raw = RawActor(learner.address, TOKEN)
            worker_address = raw.hello(pid=os.getpid(), transport="ucx", ucx=True).answer
            raw.close()
            time.sleep(0.5)
            before = rss_bytes()
            stranger = SPAWN.Process(target=ucx_stranger_proc, args=(worker_address, JUNK_BYTES, JUNK_MESSAGE, out))
            stranger.start()
            messages = out.get(timeout=120)
            stranger.join(30)
            time.sleep(1)
            grown = rss_bytes() - before
            assert learner.stats()["connected_actors"] == 1  # still stalled, its header still kept
        finally:
            stop.set()
            stalled.join(30)
    print(f"stranger: {messages} messages behind a kept header; learner grew {grown / 2**20:.1f} MiB")
    assert messages * JUNK_MESSAGE >= JUNK_BYTES
    assert grown < 48 << 20, f"the learner grew by {grown >> 20} MiB with {JUNK_BYTES >> 20} MiB of junk"


def _one_hostile_session(target: Any) -> tuple[str, list[dict], int]:
    """Run ``target`` (a hostile.py process) against a ucx learner: what the learner told it,
    the ended sessions, and the steps that reached the ring."""
    with Learner("127.0.0.1:0", token=TOKEN, transport="ucx") as learner:
        out = SPAWN.Queue()
        proc = SPAWN.Process(target=target, args=(learner.address, TOKEN, out))
        proc.start()
        said = out.get(timeout=60)
        proc.join(30)
        stats = learner.stats()
    return said, stats["ended_actors"], stats["buffer"]["steps_in"]


@pytest.mark.timeout(120)
def test_payload_that_no_header_announced_ends_the_session_that_sent_it():
    said, ended, _ = _one_hostile_session(ucx_unannounced_payload_proc)
    # Kept, the message would have waited in the worker for a receive that never comes.
    assert "no frame header announced" in said, said
    assert ended and ended[0]["protocol_errors"] == 1, ended


@pytest.mark.timeout(120)
def test_a_header_message_without_the_small_fields_it_announces_ends_that_session():
    # Small fields travel inside the header's message (ucx_setup.inline_fields); one that says a
    # step of 8 bytes follows and carries none must not leave the ring with unwritten bytes.
    said, ended, steps = _one_hostile_session(ucx_short_header_proc)
    assert "does not match its small fields" in said, said
    assert ended and ended[0]["protocol_errors"] == 1, ended
    assert steps == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("field_bytes", [6 * 1024, 64 * 1024], ids=["eager", "rendezvous"])
def test_a_payload_message_shorter_than_its_field_ends_that_session_and_no_step_is_torn(field_bytes: int):
    # UCX completes a receive with a shorter message and says nothing; the rest of the field
    # would have kept whatever the ring held there before.
    said, ended, steps = _one_hostile_session(functools.partial(ucx_short_payload_proc, field_bytes=field_bytes))
    assert f"a payload message of {field_bytes - 1024} bytes for a field of {field_bytes}" in said, said
    assert ended and ended[0]["protocol_errors"] == 1, ended
    assert steps == 0


def _tcp_address_for_ucx() -> str | None:
    """A non-loopback IPv4 address of this host on an interface UCX's TCP transport uses."""
    usable = set(ucx_probe.transports().get("tcp", [])) - {"lo"}
    for name, addr in interfaces.addresses():
        if name in usable and ":" not in addr:
            return addr
    return None


@pytest.mark.timeout(120)
def test_ucx_listens_only_on_the_interface_of_the_control_channel_on_both_sides():
    ip = _tcp_address_for_ucx()
    if ip is None:
        pytest.skip("no non-loopback interface for UCX's TCP transport here")
    before = listening_sockets()
    with Learner(f"{ip}:0", token=TOKEN, transport="ucx") as learner:
        dataset = RLinkDataset(learner, batch_size=100)
        stop, out = SPAWN.Event(), SPAWN.Queue()
        honest = SPAWN.Process(target=paced_int_proc, args=(learner.address, TOKEN, "ucx", stop, out))
        honest.start()
        seen: list[int] = []
        while len(seen) < 1000:
            seen.extend(dataset.fetch(timeout=60)["x"].tolist())
        ours = listening_sockets() - before  # the learner's listener and its UCX worker's
        stop.set()
        n, actors, transport = out.get(timeout=60)
        honest.join(30)
    assert transport == "ucx"
    assert len(ours) >= 2, ours  # the control listener and at least one of UCX's
    assert {addr for addr, _ in ours} == {ip}, f"the learner's UCX listens beyond {ip}: {ours}"
    assert actors and {addr for addr, _ in actors} == {ip}, f"the actor's UCX listens beyond {ip}: {actors}"

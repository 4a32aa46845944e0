"""Sessions that take their credit and ignore the learner's Revoke (never Returned, never a
frame, heartbeats kept up) are ended once the revoked credit is overdue, and an honest actor
gets the ring they sat on (found by a hostile-input audit: four such sessions held the whole
ring, and an honest actor's flush timed out with 0 of 2,000 steps acknowledged)."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner, RLinkDataset
from rlink_ucx.errors import RLinkError
from rlink_ucx.wire import messages as _wire
from tests.integration.hostile import RawActor

TOKEN = b"credit-hoarding-test-token-0123456789"
HOARDERS = 4
STEPS = 2000
# A small ring (131,072 steps of 8 bytes, frames of 8,192) and a revoke deadline of
# heartbeat_timeout + frame_timeout = 4 s.
LEARNER_CONFIG = Config(buffer_bytes=1 << 20, frame_bytes=64 << 10, heartbeat_interval=0.5,
                        heartbeat_timeout=2.0, frame_timeout=2.0)  # fmt: skip


def _hoarder(address: str) -> RawActor:
    """An authenticated tcp session with a schema and the credit it was granted."""
    raw = RawActor(address, TOKEN, timeout=10)
    raw.hello(pid=1, transport="tcp")
    raw.attach()
    raw.expect(_wire.Ready)
    raw.propose([["x", "int64", []]])
    raw.expect(_wire.Credit)
    return raw


def _keep_alive(hoarders: list[RawActor], revoked: set[int], stop: threading.Event) -> None:
    """Heartbeat every hoarder (so none is ended for silence) and read, but ignore, whatever
    the learner says, noting who was sent a Revoke."""
    while not stop.is_set():
        for raw in hoarders:
            # Stops at nothing more to read now (a timeout), or once the session has ended.
            with contextlib.suppress(OSError, EOFError, RLinkError):
                raw.send(raw.control, _wire.Heartbeat())
                raw.control.settimeout(0.01)
                while True:
                    if isinstance(raw.recv(raw.control), _wire.Revoke):
                        revoked.add(raw.welcome.actor_id)
        stop.wait(0.3)


def _ended_ids(learner: Learner) -> set[int]:
    return {e["actor_id"] for e in learner.stats()["ended_actors"]}


@pytest.mark.timeout(40)
def test_sessions_that_ignore_revoke_are_ended_and_an_honest_actor_gets_the_ring():
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=LEARNER_CONFIG) as learner:
        dataset = RLinkDataset(learner, batch_size=100)
        hoarders: list[RawActor] = []
        revoked: set[int] = set()
        stop = threading.Event()
        keeper = threading.Thread(target=_keep_alive, args=(hoarders, revoked, stop), daemon=True)
        try:
            for _ in range(HOARDERS):
                hoarders.append(_hoarder(learner.address))
            keeper.start()
            assert learner._server.ring.grantable() == 0  # between them they hold the whole ring
            hoarder_ids = {raw.welcome.actor_id for raw in hoarders}

            started = time.monotonic()
            got: list[int] = []
            with Actor(learner.address, token=TOKEN, transport="tcp") as actor:
                for s in range(0, STEPS, 100):
                    actor.put_many({"x": np.arange(s, s + 100, dtype=np.int64)})
                actor.flush(15)  # TimeoutError before the fix: no credit ever came
                while len(got) < STEPS:
                    got += dataset.fetch(timeout=10)["x"].tolist()
                honest_id, reconnects = actor.stats()["actor_id"], actor.stats()["reconnects"]
            took = time.monotonic() - started
            # A hoarder asked late (as an idle session, once the ring was full) is ended within
            # the deadline too: wait for it while the hoarders still heartbeat.
            limit = time.monotonic() + 8
            while time.monotonic() < limit and not revoked <= _ended_ids(learner):
                time.sleep(0.1)
        finally:
            stop.set()
            if keeper.is_alive():
                keeper.join(5)
            for raw in hoarders:
                raw.close()

        assert got == list(range(STEPS))
        assert took < 15, took  # the 4 s deadline, not a flush timeout
        assert reconnects == 0  # the honest actor was never ended
        ended = learner.stats()["ended_actors"]
        by_id = {e["actor_id"]: e for e in ended}
        assert not [e for e in ended if e["actor_id"] == honest_id and e["state"] == "lost"], ended
        # The first three hoarders were asked to give credit back as others joined (the fourth
        # maybe later, as an idle session when the ring was full): each one asked was ended.
        assert len(revoked) >= HOARDERS - 1 and revoked <= hoarder_ids, (revoked, hoarder_ids)
        for actor_id in revoked:
            entry = by_id.get(actor_id)
            assert entry is not None, (actor_id, ended)
            assert entry["state"] == "lost" and entry["protocol_errors"] == 1, entry
            assert entry["credit"] == 0, entry  # its credit went back to the ring
            assert "protocol error: kept revoked credit past 4s" in entry["error"], entry

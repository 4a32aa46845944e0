"""The actors of one I/O loop send to one learner worker through one UCX worker of theirs (an
endpoint each): making a worker per actor blocked the shared loop for seconds when hundreds
of actors started together (docs/benchmarks.md, "The ucx plane's start-up storm")."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rlink_ucx import Config
from tests.conftest import ucx_importable

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")]


def _connect(loop: asyncio.AbstractEventLoop, address: bytes):
    from rlink_ucx.transport.ucx.actor import UcxActorPlane

    welcome = SimpleNamespace(answer=address)
    return loop.run_until_complete(UcxActorPlane.connect(loop, welcome, b"k" * 32, 0, Config(), loopback=True))


def test_the_actors_of_a_loop_share_a_worker_per_learner_worker_and_the_last_close_releases_it():
    from rlink_ucx.transport.ucx import actor as ucx_actor
    from rlink_ucx.transport.ucx.setup import make_worker

    learners = [make_worker(Config(), loopback=True)[2] for _ in range(2)]  # two learner workers
    first, second = (bytes(w.address.tobytes()) for w in learners)
    loop, other_loop = asyncio.new_event_loop(), asyncio.new_event_loop()
    planes = []
    try:
        before = len(ucx_actor._workers)
        planes = [_connect(loop, first), _connect(loop, first), _connect(loop, second), _connect(other_loop, first)]
        a, b, to_second, other = planes
        assert a.worker is b.worker and a.endpoint is not b.endpoint
        assert to_second.worker is not a.worker  # another learner worker: another of ours
        assert other.worker is not a.worker  # another loop (its own thread): another worker
        assert len(ucx_actor._workers) == before + 3
        shared = a.worker
        a.close()
        assert b.worker is shared and len(ucx_actor._workers) == before + 3  # b still sends through it
        a.close()  # a second close changes nothing
        assert len(ucx_actor._workers) == before + 3
        b.close()
        assert len(ucx_actor._workers) == before + 2  # its last user closed: released
        c = _connect(loop, first)  # a later actor makes a fresh one
        planes.append(c)
        assert c.worker is not None and c.worker is not shared
    finally:
        for plane in planes:
            plane.close()
        loop.close()
        other_loop.close()
    assert len(ucx_actor._workers) == before

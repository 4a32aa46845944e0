"""Rank 0's placement, in one process over real sockets: rank 0 (a LearnerServer of a job of
two) places no actor until every rank has linked, then splits the actors; "rank 1" is a lone
learner that a rank link (the real client) advertises, so a redirected actor streams to it."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner
from rlink_ucx.session.learner.ranks.link import RankLinkClient
from rlink_ucx.session.learner.server import LearnerServer
from rlink_ucx.transport.loop import IOThread

TOKEN = b"placement-test-token-0123456789"
RANK_TOKEN = b"placement-test-rank-token-0123456789"


@pytest.mark.timeout(120)
def test_no_actor_is_placed_before_every_rank_links_then_they_are_split():
    config = Config(connect_timeout=60)
    io = IOThread(name="rank0-io")
    rank0 = LearnerServer("127.0.0.1", 0, token=TOKEN, transport="tcp", config=config, loop=io.loop, rank=0, world=2)
    io.call(rank0.start(RANK_TOKEN), 30)
    rank1 = Learner("127.0.0.1:0", token=TOKEN, transport="tcp")
    made: list[Actor] = []
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            actor = Actor(f"127.0.0.1:{rank0.port}", token=TOKEN, transport="tcp", config=config)
            actor.put({"x": np.zeros(2, np.float32)})
            actor.flush(timeout=30)
            made.append(actor)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=connect) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        time.sleep(2.0)  # the actors ask rank 0 again and again meanwhile
        assert rank0.sessions == {} and rank0.ranks is not None and rank0.ranks.placed == {}
        assert not made and not errors

        async def link() -> RankLinkClient:
            client = RankLinkClient(1, 2, ("127.0.0.1", rank0.port), ("127.0.0.1", rank1.port), (TOKEN, RANK_TOKEN), config,
                                    set)  # fmt: skip
            rank0._spawn(client.run())
            await asyncio.wait_for(client.linked.wait(), 10)
            return client

        client = io.call(link(), 20)
        for t in threads:
            t.join(60)
        assert not errors and len(made) == 2
        assert len(rank0.sessions) == 1 and rank1.stats()["connected_actors"] == 1  # one actor each
        assert sorted(a.stats()["learner_rank"] for a in made) == [0, 1]
        assert rank0.snapshot()["ranks"][1] == {"address": f"127.0.0.1:{rank1.port}", "actors": 1}

        async def unlink() -> None:
            client.close()

        io.call(unlink(), 10)
    finally:
        for actor in made:
            actor.close()
        rank1.close()
        io.call(rank0.stop(), 10)
        io.stop(5)

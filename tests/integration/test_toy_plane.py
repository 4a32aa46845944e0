"""A fourth data plane is one module and one ``register`` line: ``ToyPlane`` below (tcp under
another name, with an offer, an answer and an attach detail of its own) reaches a real learner
and a real actor process through ``RLINK_PLANES`` and streams steps end to end.

It registers only where ``RLINK_PLANES`` names this module (the spawned learner and actor):
pytest imports every test module into one process, where the other tests count three planes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import msgspec
import numpy as np
import pytest

from rlink_ucx.errors import ProtocolError
from rlink_ucx.transport.plane import PLUGINS_ENV, ActorSide, Attached, Opening, decode_blob, encode_blob, register
from rlink_ucx.transport.tcp.plane import TcpOpening, TcpPlane, open_data_connection, send_timeout
from rlink_ucx.transport.tcp.stream import TcpSender
from tests.integration.procs import encoded_steps, stream_actor

SPAWN = mp.get_context("spawn")


class ToyBlob(msgspec.Struct, array_like=True, frozen=True):
    """The toy plane's offer (actor), answer (learner) and attach detail (actor): who says it."""

    who: str
    pid: int


class ToyOpening(TcpOpening):
    """The toy plane's session: its attach reads the actor's offer and attach detail."""

    def __init__(self, plane: type[ToyPlane], reason: str, *, owner: ToyPlane, congestion: str):
        super().__init__(plane, reason, answer=encode_blob(ToyBlob("learner", os.getpid())), congestion=congestion)
        self.owner = owner

    def attach(self, session, conn, msg):
        offer = decode_blob(session.hello.offers[ToyPlane.name], ToyBlob, "toy offer")
        detail = decode_blob(msg.detail, ToyBlob, "toy attach detail")
        if offer != ToyBlob("actor", session.hello.pid) or detail != offer:
            raise ProtocolError(f"toy plane: offer {offer} and attach detail {detail} disagree")
        self.owner.attached += 1
        return super().attach(session, conn, msg)


class ToyPlane(TcpPlane):
    """A second TCP connection per actor, as ``tcp``, chosen only by name."""

    name = "toy"
    preference = 9
    every_actor = False

    @classmethod
    def offer(cls) -> bytes | None:
        return encode_blob(ToyBlob("actor", os.getpid()))

    @classmethod
    async def connect(cls, side: ActorSide) -> Attached:
        answer = decode_blob(side.welcome.answer, ToyBlob, "toy answer")
        if answer.who != "learner":
            raise ProtocolError(f"toy plane: unexpected answer {answer}")
        data = await open_data_connection(side, encode_blob(ToyBlob("actor", os.getpid())))
        return Attached(TcpSender(data.sock, side.loop, send_timeout(side), side.config.tcp_congestion), side.welcome)

    def __init__(self, context: Any):
        super().__init__(context)
        self.attached = 0

    def open(self, reason: str) -> Opening:
        return ToyOpening(ToyPlane, reason, owner=self, congestion=self.context.config.tcp_congestion)

    def counters(self) -> dict[str, int]:
        return {"toy_attached": self.attached}


if __name__ in os.environ.get(PLUGINS_ENV, "").split(","):
    register(ToyPlane)


def toy_learner(n_actors: int, n_steps: int, batch_size: int, addresses: Any, results: Any) -> None:
    """A learner on the toy plane: fetch every step, report what arrived and its stats."""
    from rlink_ucx import Learner, RLinkDataset

    with Learner("127.0.0.1:0", transport="toy") as learner:
        addresses.put(learner.address)
        dataset = RLinkDataset(learner, batch_size=batch_size)
        got: dict[str, list[Any]] = {"obs": [], "actor": [], "seq": []}
        for _ in range(n_actors * n_steps // batch_size):
            batch = dataset.fetch(timeout=60)
            got["obs"].append(batch["obs"].numpy().copy())
            got["actor"].append(batch.actor_id.numpy().copy())
            got["seq"].append(batch.seq.numpy().copy())
        # The actors' flushes ask for an ack of what we hold: closing before they have it fails
        # their flush with Closed (the learner sends no ack with its Bye).
        deadline = time.monotonic() + 30
        while learner.stats()["actors"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = learner.stats()
        rows = [*stats["actors"], *stats["ended_actors"]]
        results.put(({k: np.concatenate(v) for k, v in got.items()}, stats["toy_attached"],
                     sorted({row["transport"] for row in rows})))  # fmt: skip


@pytest.mark.timeout(120)
def test_a_plane_registered_from_this_file_alone_streams_end_to_end(monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, __name__)  # the spawned learner and actors inherit it
    n_actors, n_steps, batch_size = 2, 2_000, 250
    addresses, results = SPAWN.Queue(), SPAWN.Queue()
    learner = SPAWN.Process(target=toy_learner, args=(n_actors, n_steps, batch_size, addresses, results))
    learner.start()
    actors: list[Any] = []
    try:
        address = addresses.get(timeout=60)
        actors = [SPAWN.Process(target=stream_actor, args=(address, "toy", a + 1, n_steps)) for a in range(n_actors)]
        for p in actors:
            p.start()
        got, attached, transports = results.get(timeout=90)
        for p in [*actors, learner]:
            p.join(30)
        assert [p.exitcode for p in [*actors, learner]] == [0] * (n_actors + 1)
    finally:
        for p in [*actors, learner]:
            if p.is_alive():
                p.kill()
    assert attached == n_actors  # each attach read the actor's offer and detail
    assert transports == ["toy"]
    for a in range(1, n_actors + 1):
        mine = got["actor"] == a
        assert got["seq"][mine].tolist() == list(range(n_steps))
        np.testing.assert_array_equal(got["obs"][mine], encoded_steps(a, n_steps)["obs"])

"""The broadcast fan-out on NCCL (``Config(weights_fanout="broadcast")`` with a CUDA model,
``weights/broadcast.py``): the learner and an actor that says it is on another host (so it is
its host's streamer) form an NCCL group; each version's bytes go by broadcast from the learner's
GPU, through the actor's GPU, into host memory, checked against the key and Seal from the
control connection. NCCL wants one GPU per rank: on a machine with one GPU the group cannot
form (or breaks at its first collective), and the check is that the fan-out falls back to the
weights stream without losing a version and without hanging ``publish``. Skipped without CUDA
(``ci/gpu-check.sh`` runs it on a GPU machine)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from rlink_ucx import Config, Learner

VERSIONS = 8
FLOATS = 1 << 20  # 4 MiB a version


def _actor(address: str, device: int, results) -> None:  # type: ignore[no-untyped-def]
    import socket
    import traceback

    socket.gethostname = lambda: "rlink-nccl-peer"  # another host: this actor is its host's streamer
    import numpy as np
    import torch

    from rlink_ucx import Actor, Config

    try:
        torch.cuda.set_device(device)
        config = Config(weights_fanout="broadcast", weights_timeout=12.0)
        seen, exact = [], True
        with Actor(address, transport="tcp", subscribe=True, config=config) as actor:
            version = 0
            while version < VERSIONS:
                state, version = actor.get_remote_model(timeout=60, format="numpy", newer_than=version)
                exact = exact and bool(np.all(state["w"] == np.float32(version)))
                seen.append(version)
            results.put({"seen": seen, "exact": exact, "stats": actor.stats()["weights"]})
    except BaseException:  # noqa: BLE001 - the test reports it
        results.put({"error": traceback.format_exc()})


@pytest.mark.timeout(150)
def test_versions_go_by_nccl_broadcast_or_fall_back_to_the_stream():
    two = torch.cuda.device_count() > 1
    config = Config(weights_fanout="broadcast", weights_timeout=12.0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        learner.publish({"w": torch.full((FLOATS,), 1.0, device="cuda:0")})
        proc = ctx.Process(target=_actor, args=(learner.address, 1 if two else 0, results), daemon=True)
        proc.start()
        deadline = time.monotonic() + 60
        while not learner.stats()["actors"] or learner.stats()["actors"][0]["weights_version"] < 1:
            assert time.monotonic() < deadline and proc.is_alive(), "the actor never took version 1"
            time.sleep(0.1)
        if two:  # the group forms on NCCL once the streamer holds version 1
            while learner.stats()["weights"]["broadcast"]["members"] < 1:
                assert time.monotonic() < deadline, learner.stats()["weights"]["broadcast"]
                time.sleep(0.1)
        for version in range(2, VERSIONS + 1):
            started = time.monotonic()
            learner.publish({"w": torch.full((FLOATS,), float(version), device="cuda:0")})
            learner.wait_published(version, timeout=30)
            assert time.monotonic() - started < 35  # never held by the group
            time.sleep(0.5)
        got = results.get(timeout=90)
        cast = learner.stats()["weights"]["broadcast"]
    proc.join(30)
    assert "error" not in got, got.get("error")
    assert got["exact"] and got["seen"][-1] == VERSIONS, got
    print(cast, got["stats"])
    if two:
        assert cast["backend"] == "nccl" and cast["versions"] >= 1 and got["stats"]["broadcast"] >= 1, (cast, got)

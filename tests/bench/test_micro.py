"""Micro benchmarks of the hot paths (pytest-benchmark), one operation each.

    pip install -c ci/constraints-cpu.txt -e ".[bench,test]"
    pytest tests/bench/test_micro.py -m slow --benchmark-columns=min,median,ops --benchmark-sort=name

Each benchmark also checks its result, so a fast wrong answer fails. A timed run takes several
seconds of calibrated rounds, so they are marked ``slow`` (out of the default run); the default
run calls each once with ``--benchmark-disable`` (test_micro_once.py) to keep them working. The
numbers of a real run are in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner, RLinkDataset
from rlink_ucx.store.gather import BatchAssembler
from rlink_ucx.store.ring import StepRing
from rlink_ucx.transport.shm import channel as shm
from rlink_ucx.transport.shm import cma
from rlink_ucx.wire.codec import Schema
from rlink_ucx.wire.frame import FrameHeader

pytest.importorskip("pytest_benchmark", reason="the test and bench extras install pytest-benchmark")
pytestmark = pytest.mark.slow

CARTPOLE = Schema.from_spec({"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ()),
                             "done": ("bool", ())})  # fmt: skip
linux_only = pytest.mark.skipif(not shm.available(), reason="memfd and process_vm_readv are Linux")


def test_frame_header_pack_unpack(benchmark):
    header = FrameHeader(1, 64, 3, 12345, 1 << 40, 7, 64 * 21)
    got = benchmark(lambda: FrameHeader.unpack(header.pack()))
    assert got == header


def _frame_into_ring(ring: StepRing, seq: int, n: int) -> None:
    ring.grant(n)
    seg = ring.reserve(n, actor_id=1, seq=seq, version=0)
    obs = ring.field_views(seg)[0]
    np.frombuffer(obs[0], np.float32)[:] = seq  # the first field of the first step run
    ring.commit(seg)


def test_ring_frame_cycle(benchmark):
    """One 64-step frame through the learner's ring: reserve, commit, take, release."""
    ring = StepRing(CARTPOLE, 1 << 20, max_frame_steps=64, chunk_steps=64)
    state = {"seq": 0}

    def cycle():
        _frame_into_ring(ring, state["seq"], 64)
        pieces, take = ring.take(64, timeout=1)
        ring.release(take)
        state["seq"] += 64
        return pieces

    pieces = benchmark(cycle)
    assert sum(p.count for p in pieces) == 64 and pieces[0].seq == state["seq"] - 64
    ring.close()


def test_batch_gather_256_cartpole_steps(benchmark):
    """A CPU batch gathered from four 64-step frames (the ring's chunks are not the batch)."""
    ring = StepRing(CARTPOLE, 1 << 20, max_frame_steps=64, chunk_steps=64)
    assembler = BatchAssembler(ring, 256, "cpu")
    state = {"seq": 0}

    def cycle():
        for _ in range(4):
            _frame_into_ring(ring, state["seq"], 64)
            state["seq"] += 64
        pieces, take = ring.take(256, timeout=1)
        return assembler.assemble(pieces, take, 0)

    batch = benchmark(cycle)
    assert batch["obs"].shape == (256, 4) and batch.seq.tolist() == list(range(state["seq"] - 256, state["seq"]))
    ring.close()


@pytest.fixture(scope="module")
def streaming_actor():
    """A learner, a consumer thread draining it, and an actor in this process (tcp plane)."""
    learner = Learner("127.0.0.1:0", transport="tcp")
    dataset = RLinkDataset(learner, batch_size=4096)
    stop = threading.Event()
    fetched = []

    def drain():
        while not stop.is_set():
            try:
                fetched.append(len(dataset.fetch(timeout=0.2).seq))
            except Exception:  # noqa: BLE001, S110 - a timeout while idle, or closed at the end
                pass

    consumer = threading.Thread(target=drain, daemon=True)
    consumer.start()
    actor = Actor(learner.address, transport="tcp", config=Config(put_timeout=10))
    yield actor, fetched
    actor.flush(30)
    stop.set()
    consumer.join(5)
    actor.close()
    learner.close()


def test_actor_put_cartpole_step(benchmark, streaming_actor):
    actor, _fetched = streaming_actor
    obs = np.ones(4, np.float32)
    step = {"obs": obs, "action": np.int64(1), "reward": np.float32(1.0), "done": np.bool_(False)}
    before = actor.stats()["steps_put"]
    benchmark(actor.put, step)
    actor.flush(30)  # everything put reached the learner
    stats = actor.stats()
    assert stats["steps_put"] > before and stats["steps_acked"] == stats["steps_put"]


def test_actor_put_many_64_cartpole_steps(benchmark, streaming_actor):
    actor, _ = streaming_actor
    steps = {"obs": np.ones((64, 4), np.float32), "action": np.ones(64, np.int64),
             "reward": np.ones(64, np.float32), "done": np.zeros(64, bool)}  # fmt: skip
    first = actor.stats()["steps_put"]
    benchmark(actor.put_many, steps)
    actor.flush(30)
    stats = actor.stats()
    put = stats["steps_put"] - first
    assert put > 0 and put % 64 == 0 and stats["steps_acked"] == stats["steps_put"]


@linux_only
def test_shm_ring_copy_in_64k(benchmark):
    ring, _nonce = shm.ShmRing.create(1 << 20)
    src = memoryview(np.random.default_rng(1).integers(0, 256, 64 << 10, dtype=np.uint8))
    state = {"pos": 0}

    def copy():
        ring.copy_in(state["pos"], src)
        state["pos"] += len(src) + 4096  # wraps around the ring now and then
        return state["pos"] - len(src) - 4096

    pos = benchmark(copy)
    out = bytearray(len(src))
    ring.copy_out(pos, memoryview(out))
    assert bytes(out) == src.tobytes()
    ring.close()


@linux_only
def test_cma_read_64k_from_a_process(benchmark):
    src = np.random.default_rng(2).integers(0, 256, 64 << 10, dtype=np.uint8)
    dst = bytearray(src.nbytes)
    benchmark(cma.read, os.getpid(), [(src.ctypes.data, src.nbytes)], [memoryview(dst)])
    assert bytes(dst) == src.tobytes()

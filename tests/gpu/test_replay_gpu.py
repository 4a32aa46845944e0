"""ReplayDataset on CUDA: a table kept on the GPU (storage="device") and host tables whose
batches go to the GPU. Skipped without CUDA (CI has none); run with ``pytest tests/gpu``."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from rlink_ucx import ReplayDataset
from tests.unit.replay_helpers import PRIO_SCHEMA, FakeLearner, new_ring, put, wait_for


def _replay(storage: str, n: int, schema=None, **kw) -> ReplayDataset:
    ring = new_ring(schema) if schema is not None else new_ring()
    r = ReplayDataset(FakeLearner(ring), device="cuda:0", storage=storage, seed=11, **kw)
    prio = np.linspace(0.1, 3.0, n) if schema is PRIO_SCHEMA else None
    put(ring, 1, 0, n // 2, frame=16, priority=None if prio is None else prio[: n // 2])
    put(ring, 2, 0, n - n // 2, frame=16, priority=None if prio is None else prio[n // 2 :])
    assert wait_for(lambda: r.inserted == n)
    return r


def _check_values(b) -> None:
    assert b["obs"].device.type == "cuda" and b.index.device.type == "cuda" and b.seq.device.type == "cuda"
    assert torch.equal(b["action"], b.actor_id * 1_000_000 + b.seq)
    assert torch.equal(b["obs"][..., 1].long(), b.seq)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kw", [
    {"capacity": 200, "batch_size": 64},
    {"capacity": 200, "batch_size": 16, "sequence_length": 4},
    {"capacity": 100, "batch_size": 32, "sampler": "prioritized", "schema": PRIO_SCHEMA},
])  # fmt: skip
def test_a_table_on_the_gpu_gives_the_host_tables_batches(kw):
    host, dev = _replay("host", 300, **kw), _replay("device", 300, **kw)
    with host, dev:
        assert dev._core.table.rows[0].device.type == "cuda"
        for _ in range(30):
            a, b = host.sample(10), dev.sample(10)
            _check_values(b)
            for k in a:
                assert torch.equal(a[k].cpu(), b[k].cpu()), k
            for attr in ("index", "weight", "actor_id", "seq"):
                assert torch.equal(getattr(a, attr).cpu(), getattr(b, attr).cpu()), attr
            if kw.get("sampler") == "prioritized":
                p = torch.rand(len(b.index), device="cuda:0") + 0.01
                host.update_priorities(a.index, p)
                dev.update_priorities(b.index, p)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage", ["host", "device"])
def test_batches_stay_whole_while_inserts_evict_the_slots_they_came_from(storage):
    # Every slot is rewritten many times while batches are gathered on the GPU; a batch read
    # after the rewrites must still hold the steps its metadata names.
    ring = new_ring(steps=8192)
    with ReplayDataset(FakeLearner(ring), capacity=256, batch_size=128, device="cuda:0", storage=storage,
                       seed=3) as r:  # fmt: skip
        put(ring, 1, 0, 256)
        assert wait_for(lambda: r.inserted == 256)
        stop = threading.Event()

        def producer() -> None:
            seq = 256
            while not stop.is_set() and seq < 200_000:
                if ring.grantable() >= 64:
                    put(ring, 1, seq, 64)
                    seq += 64
                else:
                    stop.wait(0.0005)

        thread = threading.Thread(target=producer)
        thread.start()
        try:
            batches = [r.sample(10) for _ in range(300)]
        finally:
            stop.set()
            thread.join(30)
        assert r.inserted > 2000, "the inserts did not overlap the sampling"
        torch.cuda.synchronize()
        for b in batches:
            _check_values(b)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved,loaded", [("device", "device"), ("device", "host"), ("host", "device")])
def test_checkpoints_of_gpu_tables_round_trip(tmp_path, saved, loaded):
    with _replay(saved, 500, capacity=400, batch_size=32, sampler="prioritized") as r:  # wraps: two runs
        r.update_priorities(np.arange(100, 500), np.linspace(1, 9, 400))
        before = [np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows) for rows in r._core.table.rows]
        r.save(tmp_path / "c")
    with ReplayDataset.load(tmp_path / "c", FakeLearner(new_ring()), device="cuda:0", storage=loaded) as q:
        assert len(q) == 400 and q.inserted == 500
        slots = np.arange(100, 500) % 400
        for want, rows in zip(before, q._core.table.rows):
            got = np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows)
            np.testing.assert_array_equal(got[slots], want[slots])
        np.testing.assert_array_equal(q._core.sampler.leaves(), r._core.sampler.leaves())
        _check_values(q.sample(10))


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_table_too_large_for_the_gpu_is_a_config_error():
    from rlink_ucx import ConfigError
    from rlink_ucx.store.replay.device_table import DeviceTable
    from rlink_ucx.wire.codec import Schema

    free, _ = torch.cuda.mem_get_info()
    schema = Schema.from_spec({"obs": ("uint8", (1 << 20,))})
    with pytest.raises(ConfigError, match="does not fit on cuda"):
        DeviceTable(schema, free // (1 << 20) + 1024, device="cuda:0")

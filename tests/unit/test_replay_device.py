"""storage="device": the table as torch tensors (here on the CPU), sampled by a device gather.

Every test compares against the host table fed the same steps with the same seed: the
samplers see the same ids, so the batches must be identical, not just alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlink_ucx import ConfigError, ReplayDataset
from rlink_ucx.store.replay.device_table import DeviceTable
from rlink_ucx.store.replay.table import ReplayTable
from tests.unit.replay_helpers import PRIO_SCHEMA, FakeLearner, new_ring, put, wait_for


def pair(n: int, schema=None, **kw) -> tuple[ReplayDataset, ReplayDataset]:
    """A host-storage and a device-storage replay, each fed the same ``n`` steps of two actors."""
    out = []
    for storage in ("host", "device"):
        ring = new_ring(schema) if schema is not None else new_ring()
        r = ReplayDataset(FakeLearner(ring), seed=7, storage=storage, **kw)
        prio = np.linspace(0.1, 3.0, n) if schema is PRIO_SCHEMA else None
        put(ring, 1, 0, n // 2, frame=16, priority=None if prio is None else prio[: n // 2])
        put(ring, 2, 0, n - n // 2, frame=16, priority=None if prio is None else prio[n // 2 :])
        assert wait_for(lambda r=r: r.inserted == n)
        out.append(r)
    return out[0], out[1]


def same(a, b) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].device == b[k].device
        assert torch.equal(a[k], b[k]), k
    for attr in ("index", "weight", "version", "actor_id", "seq", "staleness"):
        assert torch.equal(getattr(a, attr), getattr(b, attr)), attr


@pytest.mark.timeout(60)
def test_uniform_batches_equal_the_host_tables_and_are_flat():
    host, dev = pair(300, capacity=200, batch_size=64)  # wrapped: ids 100..299 held
    with host, dev:
        assert isinstance(dev._core.table, DeviceTable) and isinstance(dev._core.table.rows[0], torch.Tensor)
        assert type(host._core.table) is ReplayTable
        counts = np.zeros(300)
        for _ in range(300):
            a, b = host.sample(5), dev.sample(5)
            same(a, b)
            np.testing.assert_array_equal(b["action"].numpy(), b.actor_id.numpy() * 1_000_000 + b.seq.numpy())
            np.testing.assert_array_equal(b["obs"][:, 1].numpy(), b.seq.numpy())
            np.add.at(counts, b.index.numpy(), 1)
        assert counts[:100].sum() == 0  # evicted ids are never drawn
        held = counts[100:]
        chi2 = ((held - held.mean()) ** 2 / held.mean()).sum()
        assert chi2 < 290, chi2  # df 199: P(chi2 > 290) < 1e-4 for a flat law


@pytest.mark.timeout(60)
def test_prioritized_weights_and_updates_equal_the_host_tables():
    host, dev = pair(120, schema=PRIO_SCHEMA, capacity=100, batch_size=32, sampler="prioritized",
                     priority_exponent=0.7, importance_exponent=0.5)  # fmt: skip
    with host, dev:
        rng = np.random.default_rng(0)
        for _ in range(50):
            a, b = host.sample(5), dev.sample(5)
            same(a, b)
            assert float(b.weight.max()) == 1.0 and b.weight.min() > 0
            p = rng.random(32) + 0.01
            host.update_priorities(a.index, p)
            dev.update_priorities(b.index, torch.from_numpy(p))
        np.testing.assert_array_equal(host._core.sampler.leaves(), dev._core.sampler.leaves())


@pytest.mark.timeout(60)
def test_sequence_windows_equal_the_host_tables_and_never_mix_actors():
    T = 5
    host, dev = pair(400, capacity=300, batch_size=16, sequence_length=T)
    with host, dev:
        for _ in range(50):
            a, b = host.sample(5), dev.sample(5)
            same(a, b)
            assert b["obs"].shape == (16, T, 3) and b["action"].shape == (16, T)
            actor, seq = b.actor_id.numpy(), b.seq.numpy()
            assert (actor == actor[:, :1]).all() and (np.diff(seq, axis=1) == 1).all()
            np.testing.assert_array_equal(b["action"].numpy(), actor * 1_000_000 + seq)


@pytest.mark.timeout(60)
def test_a_kept_batch_of_a_device_table_is_never_overwritten():
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=300, batch_size=32, seed=2, storage="device") as r:
        put(ring, 1, 0, 300)
        assert wait_for(lambda: r.inserted == 300)
        kept = [r.sample(5) for _ in range(10)]  # more than the staging pool holds
        copies = [b["action"].clone() for b in kept]
        put(ring, 1, 300, 300)  # every slot rewritten
        assert wait_for(lambda: r.inserted == 600)
        for _ in range(20):
            r.sample(5)
        for b, action in zip(kept, copies):
            assert torch.equal(b["action"], action)
            np.testing.assert_array_equal(b["action"].numpy(), 1_000_000 + b.index.numpy())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("saved,loaded", [("device", "host"), ("host", "device")])
def test_checkpoints_move_between_host_and_device_tables(tmp_path, saved, loaded):
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=150, batch_size=20, sampler="prioritized", seed=0,
                       storage=saved) as r:  # fmt: skip
        put(ring, 1, 0, 200, frame=16)  # wraps: two runs of slots
        assert wait_for(lambda: r.inserted == 200)
        r.update_priorities(np.arange(50, 200), np.linspace(1, 9, 150))
        r.save(tmp_path / "c")
        expect = r.sample(5)
    with ReplayDataset.load(tmp_path / "c", FakeLearner(new_ring()), storage=loaded, seed=0) as q:
        assert q.storage == loaded and len(q) == 150 and q.inserted == 200
        assert isinstance(q._core.table.rows[0], torch.Tensor) == (loaded == "device")
        ids = np.arange(50, 200)
        for spec, rows in zip(q._core.table.schema.fields, q._core.table.rows):
            got = np.asarray(rows)[ids % 150]
            want = np.asarray(r._core.table.rows[q._core.table.schema.fields.index(spec)])[ids % 150]
            np.testing.assert_array_equal(got, want)
        b = q.sample(5)
        assert b["obs"].shape == expect["obs"].shape
        np.testing.assert_array_equal(b["action"].numpy(), 1_000_000 + b.index.numpy())


@pytest.mark.timeout(30)
def test_an_unknown_storage_is_a_config_error():
    with pytest.raises(ConfigError, match="storage"):
        ReplayDataset(FakeLearner(new_ring()), capacity=10, batch_size=2, storage="disk")

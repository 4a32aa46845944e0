"""Replay checkpoints: round trip, saving while steps arrive, and refusing bad checkpoints."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from rlink_ucx import ReplayDataset, SchemaMismatch
from rlink_ucx.replay import CheckpointError
from rlink_ucx.wire.codec import Schema
from tests.unit.replay_helpers import FakeLearner, new_ring, put, wait_for


def make(sampler="prioritized", capacity=300, **kw) -> ReplayDataset:
    return ReplayDataset(FakeLearner(new_ring()), capacity=capacity, batch_size=20, sampler=sampler, seed=0, **kw)


def fill(r: ReplayDataset, actor: int, seq: int, n: int) -> None:
    target = r.inserted + n
    put(r.learner.ring, actor, seq, n, frame=16)
    assert wait_for(lambda: r.inserted == target)


def all_rows(r: ReplayDataset) -> dict[str, np.ndarray]:
    t = r._core.table
    ids = np.arange(t.first, t.inserted)
    out = {}
    for spec, rows in zip(t.schema.fields, t.rows):
        out[spec.name] = np.asarray(rows)[ids % t.capacity].copy()  # numpy rows, or CPU tensors (storage="device")
    out["meta"] = np.stack(t.meta(ids))
    return out


@pytest.mark.timeout(60)
def test_round_trip_keeps_steps_ids_priorities_counters_and_goes_on_receiving(tmp_path):
    with make(samples_per_insert=2.0, min_size=10, spi_tolerance=1000, sequence_length=3) as r:
        fill(r, 1, 0, 250)
        fill(r, 2, 0, 100)  # wraps: ids 50..349 held
        b = r.sample(5)
        r.update_priorities(b.index, np.linspace(0.5, 7, 20))
        r.save(tmp_path / "ckpt")
        manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
        assert manifest["table"]["inserted"] == 350 and manifest["limiter"]["sampled"] == 20
        assert manifest["settings"]["sequence_length"] == 3
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"
        before = all_rows(r)
        leaves = r._core.sampler.leaves().copy()
        learner = FakeLearner(new_ring())
        with ReplayDataset.load(tmp_path / "ckpt", learner) as q:
            assert len(q) == 300 and q.inserted == 350 and q.sampled == 20
            after = all_rows(q)
            for k in before:
                np.testing.assert_array_equal(before[k], after[k])
            np.testing.assert_array_equal(q._core.sampler.leaves(), leaves)
            assert q._core.limiter.samples_per_insert == 2.0
            b2 = q.sample(5)
            assert b2["obs"].shape == (20, 3, 3)
            fill(q, 1, 250, 30)  # actor 1 continues its stream: windows link across the load
            assert q.inserted == 380 and len(q) == 300
            t = q._core.table
            assert t.whole_windows(np.array([350, 351])).all()  # ids 350, 351 need 248, 249 (held)
            ids = t.window_ids(np.array([351]))[0]
            np.testing.assert_array_equal(t.seq[ids % 300], [249, 250, 251])


@pytest.mark.timeout(60)
def test_fifo_cursor_survives_a_round_trip(tmp_path):
    with make("fifo", capacity=100) as r:
        fill(r, 1, 0, 100)
        assert r.sample(5).seq.tolist() == list(range(20))
        r.save(tmp_path / "f")
    with ReplayDataset.load(tmp_path / "f", FakeLearner(new_ring())) as q:
        assert q.sample(5).seq.tolist() == list(range(20, 40))


@pytest.mark.timeout(60)
def test_save_while_steps_keep_arriving_is_a_consistent_snapshot(tmp_path):
    with make("uniform", capacity=5000) as r:
        ring = r.learner.ring
        stop = threading.Event()

        def producer():
            seq = 0
            while not stop.is_set() and seq < 20_000:
                if ring.grantable() >= 16:
                    put(ring, 1, seq, 16, frame=16)
                    seq += 16
                else:
                    stop.wait(0.001)

        t = threading.Thread(target=producer)
        t.start()
        assert wait_for(lambda: r.inserted > 2000)
        for i in range(3):
            r.save(tmp_path / "c")  # the same path again: replaced
        stop.set()
        t.join(10)
    with ReplayDataset.load(tmp_path / "c", FakeLearner(new_ring())) as q:
        rows = all_rows(q)
        n = len(q)
        seq = rows["meta"][2]
        assert n > 0 and (np.diff(seq) == 1).all()  # a contiguous stretch of the stream
        assert seq[-1] == q.inserted - 1
        obs = rows["obs"].view(np.float32).reshape(n, 3)
        np.testing.assert_array_equal(obs[:, 1], seq)  # every row's bytes match its metadata


def saved(tmp_path) -> str:
    with make() as r:
        fill(r, 1, 0, 200)
        r.save(tmp_path / "ok")
    return str(tmp_path / "ok")


@pytest.mark.timeout(60)
def test_a_truncated_file_is_refused(tmp_path):
    path = saved(tmp_path)
    f = tmp_path / "ok" / "field_0.npy"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="truncated"):
        ReplayDataset.load(path, FakeLearner(new_ring()))


@pytest.mark.timeout(60)
def test_a_corrupted_byte_is_refused(tmp_path):
    path = saved(tmp_path)
    f = tmp_path / "ok" / "field_1.npy"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        ReplayDataset.load(path, FakeLearner(new_ring()))


@pytest.mark.timeout(60)
def test_a_missing_file_a_bad_manifest_or_another_format_is_refused(tmp_path):
    path = saved(tmp_path)
    (tmp_path / "ok" / "priority.npy").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        ReplayDataset.load(path, FakeLearner(new_ring()))
    (tmp_path / "ok" / "manifest.json").write_text(
        '{"format": "rlink-replay", "format_version": 99, "checksum": "sha256"}'
    )
    with pytest.raises(CheckpointError, match="format version"):
        ReplayDataset.load(path, FakeLearner(new_ring()))
    (tmp_path / "ok" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        ReplayDataset.load(path, FakeLearner(new_ring()))
    with pytest.raises(CheckpointError, match="no manifest"):
        ReplayDataset.load(tmp_path, FakeLearner(new_ring()))


@pytest.mark.timeout(60)
def test_a_checkpoint_of_another_schema_is_refused_now_or_when_the_actors_schema_arrives(tmp_path):
    path = saved(tmp_path)
    other = Schema.from_spec({"obs": ("float32", (4,)), "action": ("int64", ())})
    with pytest.raises(SchemaMismatch, match="obs"):
        ReplayDataset.load(path, FakeLearner(new_ring(other)))
    late = FakeLearner(None)
    with ReplayDataset.load(path, late) as q:
        assert len(q) == 200
        late.ring = new_ring(other)
        late.ready.set()
        assert wait_for(lambda: q._core.error is not None)  # the inserter meets the actors' schema
        with pytest.raises(SchemaMismatch, match="does not match"):
            q.sample(5)


@pytest.mark.timeout(60)
def test_a_replaced_checkpoint_is_removed_in_the_background_and_the_new_one_is_whole(tmp_path):
    from rlink_ucx.store.replay.checkpoint import wait_removals

    with make("uniform", capacity=100) as r:
        fill(r, 1, 0, 40)
        r.save(tmp_path / "c")
        fill(r, 1, 40, 30)
        r.save(tmp_path / "c")  # replaces the first: renamed aside, then removed by a thread
        wait_removals()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c"], "the old checkpoint or a temporary was left"
    with ReplayDataset.load(tmp_path / "c", FakeLearner(new_ring())) as q:
        assert len(q) == 70 and q.inserted == 70
        np.testing.assert_array_equal(all_rows(q)["meta"][2], np.arange(70))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("storage", ["host", "device"])
def test_many_small_chunks_that_split_rows_round_trip(tmp_path, monkeypatch, storage):
    from rlink_ucx.store.replay import checkpoint

    # Chunks far smaller than a field and not a multiple of a row: every boundary case of the
    # chunked hash + write (and the page-cache advice behind it) and of the chunked read.
    monkeypatch.setattr(checkpoint, "_CHUNK", 100)
    monkeypatch.setattr(checkpoint, "_READ_CHUNK", 77)
    with make(capacity=300, storage=storage) as r:
        fill(r, 1, 0, 250)
        fill(r, 2, 0, 120)  # wraps: two runs of slots
        r.update_priorities(np.arange(70, 370), np.linspace(0.5, 4, 300))
        r.save(tmp_path / "s")
        before, leaves = all_rows(r), r._core.sampler.leaves().copy()
    files = json.loads((tmp_path / "s" / "manifest.json").read_text())["files"]
    assert files["field_0.npy"]["bytes"] > 30 * 100  # obs: 300 rows of 12 bytes, over 30 chunks
    with ReplayDataset.load(tmp_path / "s", FakeLearner(new_ring()), storage=storage) as q:
        after = all_rows(q)
        for k in before:
            np.testing.assert_array_equal(before[k], after[k])
        np.testing.assert_array_equal(q._core.sampler.leaves(), leaves)


def _rewrite(path: str, name: str, array: np.ndarray) -> None:
    """What anyone who can write the directory can do: new data and a matching checksum."""
    import io

    import xxhash

    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=(2, 0))
    data = buf.getvalue()
    with open(f"{path}/{name}", "wb") as fh:
        fh.write(data)
    manifest = json.loads(open(f"{path}/manifest.json").read())
    manifest["files"][name] = {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    with open(f"{path}/manifest.json", "w") as fh:
        json.dump(manifest, fh)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_priorities_that_are_not_finite_and_non_negative_are_refused_even_with_a_matching_checksum(tmp_path, bad):
    path = saved(tmp_path)
    leaves = np.load(f"{path}/priority.npy")
    leaves[3] = bad
    _rewrite(path, "priority.npy", leaves)
    with pytest.raises(CheckpointError, match="NaN, infinite or negative priorities"):
        ReplayDataset.load(path, FakeLearner(new_ring()))


@pytest.mark.timeout(60)
def test_a_manifest_asking_for_more_memory_than_the_machine_has_is_refused_before_allocating(tmp_path):
    import tracemalloc

    path = saved(tmp_path)
    manifest = json.loads(open(f"{path}/manifest.json").read())
    manifest["settings"]["capacity"] = manifest["capacity"] = 3_000_000_000
    with open(f"{path}/manifest.json", "w") as fh:
        json.dump(manifest, fh)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=r"capacity 3000000000 needs .* GiB, more than this machine"):
            ReplayDataset.load(path, FakeLearner(new_ring()))
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(60)
def test_a_deeply_nested_or_huge_manifest_is_a_checkpoint_error(tmp_path):
    path = saved(tmp_path)
    (tmp_path / "ok" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="cannot be read"):
        ReplayDataset.load(path, FakeLearner(new_ring()))
    (tmp_path / "ok" / "manifest.json").write_text(" " * (17 << 20) + "{}")
    with pytest.raises(CheckpointError, match="over"):
        ReplayDataset.load(path, FakeLearner(new_ring()))


def test_checkpoint_error_is_exported_from_the_package():
    import rlink_ucx

    assert rlink_ucx.CheckpointError is CheckpointError and "CheckpointError" in rlink_ucx.__all__

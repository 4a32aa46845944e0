"""One step per actor from the receive ring (fetch(one_per_actor=True)), and time-major batches."""

import numpy as np
import pytest

from rlink_ucx import Closed, TimeoutError
from rlink_ucx.batch import Batch, Host
from rlink_ucx.store.lockstep import take_one_per_actor
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import Schema
from rlink_ucx.wire.frameworks import adapter

SCHEMA = Schema.from_spec({"x": ("int64", ())})


def put(ring, actor, seq, values, version=0, commit=True):
    """A frame of ``values`` from ``actor`` (committed unless told otherwise)."""
    ring.grant(len(values))
    seg = ring.reserve(len(values), actor, seq, version)
    data = np.asarray(values, dtype=np.int64).view(np.uint8)
    offset = 0
    for view in ring.field_views(seg)[0]:
        view[:] = data[offset : offset + len(view)]
        offset += len(view)
    if commit:
        ring.commit(seg)
    return seg


def taken(ring, pieces):
    return [(p.actor_id, p.seq, int(ring.piece_bytes(0, p).view(np.int64)[0])) for p in pieces]


def test_the_oldest_step_of_each_actor_out_of_fifo_order():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=4, chunk_steps=8)
    put(ring, 1, 0, [10, 11])  # actor 1: two steps in one frame
    put(ring, 2, 0, [20])
    put(ring, 1, 2, [12])
    put(ring, 3, 0, [30])
    pieces, take = take_one_per_actor(ring, lambda: {1, 2, 3}, timeout=1)
    assert taken(ring, pieces) == [(1, 0, 10), (2, 0, 20), (3, 0, 30)]
    ring.release(take)
    pieces, take = take_one_per_actor(ring, lambda: {1}, timeout=1)  # actors 2 and 3 left
    assert taken(ring, pieces) == [(1, 1, 11)]
    ring.release(take)
    pieces, take = take_one_per_actor(ring, lambda: {1}, timeout=1)
    assert taken(ring, pieces) == [(1, 2, 12)]
    ring.release(take)
    assert ring.used == 0  # every frame taken and released: all space free again


def test_an_actor_whose_oldest_frame_is_still_arriving_is_waited_for_and_kept_in_order():
    # A session has one frame open at a time, so an actor's frames complete in its order.
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=4, chunk_steps=8)
    arriving = put(ring, 1, 0, [10], commit=False)
    put(ring, 2, 0, [20])
    with pytest.raises(TimeoutError, match="min_actors=2"):
        take_one_per_actor(ring, lambda: {1, 2}, timeout=0.3, min_actors=2)
    pieces, take = take_one_per_actor(ring, lambda: {1, 2}, timeout=0.3)  # late past the timeout: what is here
    assert taken(ring, pieces) == [(2, 0, 20)]
    ring.release(take)
    ring.commit(arriving)
    put(ring, 1, 1, [11])
    pieces, take = take_one_per_actor(ring, lambda: {1, 2}, timeout=0.3, min_actors=1)
    assert taken(ring, pieces) == [(1, 0, 10)]
    ring.release(take)
    pieces, take = take_one_per_actor(ring, lambda: {1}, timeout=0.3)
    assert taken(ring, pieces) == [(1, 1, 11)]
    ring.release(take)
    assert ring.used == 0


def test_stale_steps_are_dropped_and_a_closed_ring_raises():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=4, chunk_steps=8)
    put(ring, 1, 0, [10], version=1)
    put(ring, 2, 0, [20], version=2)
    pieces, take = take_one_per_actor(ring, lambda: {2}, timeout=1, min_version=2)
    assert taken(ring, pieces) == [(2, 0, 20)] and ring.stats.stale_dropped == 1
    ring.release(take)
    ring.close()
    with pytest.raises(Closed):
        take_one_per_actor(ring, lambda: {2}, timeout=1)


def test_the_watch_is_called_while_waiting():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=4, chunk_steps=8)
    calls = []
    with pytest.raises(TimeoutError):
        take_one_per_actor(ring, set, timeout=0.35, watch=lambda: calls.append(1))
    assert len(calls) >= 2


def test_time_major_swaps_fields_with_a_time_axis_only():
    obs = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # [B, T, 4]
    first = np.array([7, 8], dtype=np.int64)  # one value per step
    meta = Host(np.array([5, 6], dtype=np.int64), "int64")
    np_adapter = adapter("numpy")
    batch = Batch({"obs": Host(obs, "float32"), "first": Host(first, "int64")}, version=meta, actor_id=meta,
                  seq=meta, staleness=meta, convert=np_adapter.array).time_major()  # fmt: skip
    assert batch["obs"].shape == (3, 2, 4) and batch["obs"].flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(batch["obs"], obs.swapaxes(0, 1))
    np.testing.assert_array_equal(batch["first"], first)
    assert batch.version.tolist() == [5, 6] and batch.batch_size == 2


def test_time_major_of_torch_tensors_as_the_cuda_path_hands_them():
    torch = pytest.importorskip("torch")
    obs = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    meta = torch.tensor([1, 2])
    batch = Batch({"obs": obs, "r": torch.tensor([1.0, 2.0])}, version=meta, actor_id=meta, seq=meta,
                  staleness=meta).time_major()  # fmt: skip
    assert batch["obs"].shape == (3, 2, 4) and batch["obs"].is_contiguous()
    assert torch.equal(batch["obs"], obs.transpose(0, 1)) and batch["r"].tolist() == [1.0, 2.0]


def test_once_every_actor_is_done_what_is_here_is_taken_then_closed():
    ring = StepRing(SCHEMA, 64 * 8, max_frame_steps=4, chunk_steps=8)
    put(ring, 1, 0, [10])
    pieces, take = take_one_per_actor(ring, set, timeout=5, min_actors=3, finished=lambda: True)
    assert taken(ring, pieces) == [(1, 0, 10)]
    ring.release(take)
    with pytest.raises(Closed, match="every actor has finished"):
        take_one_per_actor(ring, set, timeout=5, finished=lambda: True)

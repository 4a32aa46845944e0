"""The flat weights format: bit-exact round trip, manifest validation, buffer reuse."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from rlink_ucx import ProtocolError
from rlink_ucx.weights.snapshot import BufferPool, Snapshot, snapshot, state_dict_of
from rlink_ucx.wire.manifest import ALIGN, KEYED, Entry, Manifest
from rlink_ucx.wire.messages import Publish, decode, encode

pytestmark = pytest.mark.timeout(60)


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 7, generator=g),
        "w_t": torch.randn(7, 5, generator=g).t(),  # non-contiguous
        "half": torch.randn(3, generator=g).half(),
        "bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "count": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }


def raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def test_snapshot_round_trips_every_tensor_bit_exact_and_is_a_copy():
    state = sample_state()
    snap = snapshot(state, 1, 64, BufferPool())
    snap.verify()
    before = {k: v.clone() for k, v in state.items()}
    state["w"].add_(1.0)  # training goes on: the snapshot must not change
    out = snap.tensors()
    assert list(out) == list(state)
    for k, t in before.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape
        assert raw(out[k]) == raw(t), k
    assert all(e.offset % ALIGN == 0 for e in snap.manifest.entries)


def test_module_state_dict_is_accepted_and_other_objects_are_refused():
    net = torch.nn.Linear(3, 2)
    assert list(state_dict_of(net)) == ["weight", "bias"]
    with pytest.raises(TypeError):
        state_dict_of([1, 2])
    with pytest.raises(TypeError):
        state_dict_of({"w": [1.0]})


def test_a_corrupted_bucket_is_detected():
    snap = snapshot(sample_state(), 3, 64, BufferPool())
    snap.flat[70] ^= 0xFF
    snap.verify(0)
    with pytest.raises(ProtocolError, match="bucket 1"):
        snap.verify()


def manifest(**changes) -> Manifest:
    base = Manifest(1, [Entry("w", "float32", [4], 0), Entry("b", "int64", [2], 64)], 80, 64, [], KEYED)
    return msgspec.structs.replace(base, **changes)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"total_bytes": 2**41}, "max_weights_bytes"),
        ({"entries": [Entry("w", "float32", [2**20], 0)]}, "outside"),
        ({"entries": [Entry("w", "object", [1], 0)]}, "dtype"),
        ({"entries": [Entry("w", "float32", [1], 0), Entry("w", "float32", [1], 64)]}, "duplicate"),
        ({"entries": [Entry("w", "float32", [-1], 0)]}, "shape"),
        ({"entries": [Entry("w", "float32", [1], 3)]}, "outside"),
        ({"checksums": [0]}, "checksums"),
        ({"checksums": [0, 0], "checksum": "xxh3"}, "checksums"),  # unkeyed checksums are refused
        ({"checksum": "pickle"}, "checksums"),
        ({"bucket_bytes": 100}, "bucket"),
        ({"bucket_bytes": 0}, "bucket"),
        ({"total_bytes": 2**30, "bucket_bytes": 64}, "buckets; limit"),  # found by the fuzz test: an OOM
        ({"version": 0}, "version"),
    ],
)
def test_manifest_validation_rejects_before_allocating(changes, match):
    bad = manifest(**changes)
    with pytest.raises(ProtocolError, match=match):
        bad.validate(max_bytes=2**40, max_entries=10)


def test_too_many_tensors_are_refused():
    entries = [Entry(f"t{i}", "uint8", [1], 64 * i) for i in range(11)]
    with pytest.raises(ProtocolError, match="limit"):
        manifest(entries=entries, total_bytes=64 * 11).validate(max_bytes=2**40, max_entries=10)


def test_manifest_survives_the_wire_and_a_valid_one_passes():
    snap = snapshot(sample_state(), 2, 128, BufferPool())
    msg = decode(encode(Publish(snap.manifest))[4:])
    assert isinstance(msg, Publish) and msg.manifest == snap.manifest
    msg.manifest.validate(max_bytes=2**20, max_entries=100)


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_buffer_pool_never_reuses_a_buffer_someone_still_reads(shared):
    pool = BufferPool(shared=shared)
    first = snapshot({"w": torch.ones(1000)}, 1, 1 << 20, pool)
    kept = first.tensors()["w"]  # the caller keeps a view of version 1
    first = None
    second = snapshot({"w": torch.full((1000,), 2.0)}, 2, 1 << 20, pool)
    assert kept.eq(1.0).all(), "version 1 was overwritten while still referenced"
    address = second.flat.ctypes.data
    second = None
    third = snapshot({"w": torch.full((1000,), 3.0)}, 3, 1 << 20, pool)
    assert third.flat.ctypes.data == address, "a released buffer should be reused"
    assert kept.eq(1.0).all()
    assert isinstance(third, Snapshot) and np.all(third.tensors()["w"].numpy() == 3.0)
    assert (third.shared is not None) == shared


def test_the_host_copy_of_a_device_snapshot_waits_until_it_is_sealed():
    """The fan-out thread starts while ``publish`` is still copying a CUDA model; a host copy
    (for the weights streams) taken then would send, and cache for every later stream, a half-written
    model. A CPU torch buffer labelled as a device snapshot takes the same code path."""
    import threading
    import types

    from rlink_ucx.config import Config
    from rlink_ucx.weights.publisher import Publisher
    from rlink_ucx.weights.snapshot import fill, layout, sources

    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.full((7,), 3.0)}
    entries, total = layout(state)
    flat = torch.zeros(total, dtype=torch.uint8)
    snap = Snapshot(Manifest(1, entries, total, 256, [], KEYED), flat, "cuda:0", sealed=False)
    publisher = Publisher(types.SimpleNamespace(config=Config(weights_timeout=20.0), loop=None))
    copies: list[Snapshot] = []
    copier = threading.Thread(target=lambda: copies.append(publisher.streams._host_copy(snap)))
    copier.start()
    copier.join(0.3)
    assert copier.is_alive() and not copies  # still waiting: nothing was copied yet
    fill(snap, sources(snap, state))
    copier.join(10)
    assert len(copies) == 1
    host = copies[0]
    assert host.device == "cpu" and host.manifest is snap.manifest
    assert host.key is snap.key and host.tags == snap.tags  # tagged on the device, same bytes
    host.verify()
    got = host.tensors()
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert publisher.streams._host_copy(snap) is host  # made once per version

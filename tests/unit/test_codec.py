"""Codec round trips through the real frame buffer, ring and batch assembler (no network)."""

import sys

import numpy as np
import pytest
import torch

from rlink_ucx import ProtocolError, Schema, SchemaMismatch
from rlink_ucx.session.actor.link import FrameBuffer
from rlink_ucx.store.gather import BatchAssembler
from rlink_ucx.store.ring import StepRing
from rlink_ucx.wire.codec import FieldSpec, as_host_array, infer_schema

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_]
SHAPES = [(), (3,), (2, 3), (2, 1, 3), (2, 2, 1, 3)]


def roundtrip(steps: dict, n: int) -> dict:
    """Encode ``n`` steps into a frame as the actor does, land them in a ring, fetch a batch."""
    schema = infer_schema(steps, leading_dims=1)
    fb = FrameBuffer(schema, n)
    fb.reset(0, 7)
    for typed, (name, value) in zip(fb.typed, steps.items()):
        arr, _ = as_host_array(value)
        typed[:n] = arr
    fb.n = n
    ring = StepRing(schema, 1 << 20, n)
    seg = ring.reserve(n, actor_id=3, seq=100, version=7)
    for dsts, src in zip(ring.field_views(seg), fb.payload(0, n)):
        (dst,) = dsts  # an empty ring: one contiguous run per field
        dst[:] = src
    ring.commit(seg)
    pieces, take = ring.take(n, timeout=1)
    batch = BatchAssembler(ring, n, "cpu").assemble(pieces, take, learner_version=9)
    assert batch.actor_id.tolist() == [3] * n
    assert batch.seq.tolist() == list(range(100, 100 + n))
    assert batch.version.tolist() == [7] * n and batch.staleness.tolist() == [2] * n
    return dict(batch)


def random_array(dtype, shape, rng):
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(size=shape) * 1e3).astype(dtype)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
def test_roundtrip_bit_exact(dtype, shape):
    rng = np.random.default_rng(0)
    value = random_array(dtype, (5, *shape), rng)
    out = roundtrip({"x": value}, 5)["x"]
    assert out.shape == (5, *shape)
    assert out.numpy().tobytes() == np.ascontiguousarray(value).tobytes()


@pytest.mark.timeout(30)
def test_roundtrip_special_floats_are_bit_exact():
    value = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 5e-324], dtype=np.float64)
    out = roundtrip({"x": value.reshape(7, 1)}, 7)["x"]
    assert out.numpy().tobytes() == value.tobytes()


@pytest.mark.timeout(30)
def test_roundtrip_bfloat16_and_torch_inputs():
    bf = torch.randn(6, 2, 3).to(torch.bfloat16)
    i64 = torch.arange(6, dtype=torch.int64) * (2**40)
    out = roundtrip({"bf": bf, "i": i64}, 6)
    assert out["bf"].dtype == torch.bfloat16
    assert torch.equal(out["bf"].view(torch.int16), bf.view(torch.int16))
    assert torch.equal(out["i"], i64)


@pytest.mark.timeout(30)
def test_roundtrip_non_contiguous_inputs():
    base = np.arange(6 * 8 * 4, dtype=np.float32).reshape(6, 8, 4)
    strided = base[:, ::2, 1:3]  # non-contiguous view
    transposed = torch.from_numpy(np.arange(6 * 5, dtype=np.int32).reshape(5, 6)).t()
    assert not strided.flags["C_CONTIGUOUS"] and not transposed.is_contiguous()
    out = roundtrip({"s": strided, "t": transposed}, 6)
    assert np.array_equal(out["s"].numpy(), strided)
    assert torch.equal(out["t"], transposed)


def test_infer_schema_from_step_and_chunk():
    step = {"obs": np.zeros((4,), np.float32), "action": 3, "reward": 1.0, "done": False}
    schema = infer_schema(step)
    assert [(f.name, f.dtype, f.shape) for f in schema.fields] == [
        ("obs", "float32", (4,)), ("action", "int64", ()), ("reward", "float32", ()), ("done", "bool", ()),
    ]  # fmt: skip
    assert schema.step_bytes == 16 + 8 + 4 + 1
    chunk = infer_schema({"obs": np.zeros((8, 4), np.float32)}, leading_dims=1)
    assert chunk.fields[0].shape == (4,)


def test_schema_compare_names_both_sides():
    a = Schema.from_spec({"obs": ("float32", (4,)), "r": ("float32", ())})
    b = Schema.from_spec({"obs": ("float64", (4,)), "r": ("float32", ())})
    assert a != b and a.fingerprint != b.fingerprint
    text = a.compare(b)
    assert "obs" in text and "float32[4]" in text and "float64[4]" in text


def test_unsupported_dtype_is_rejected():
    with pytest.raises(SchemaMismatch, match="unsupported dtype"):
        infer_schema({"x": np.zeros(2, dtype=np.complex64)})
    with pytest.raises(SchemaMismatch):
        infer_schema({"x": np.array(["a"], dtype=object)})


@pytest.mark.parametrize(
    "fields",
    [
        [],
        "obs",
        [["x", "float32"]],
        [["x", "object", [1]]],
        [["x", "float32", [-1]]],
        [["x", "float32", [2**40]]],
        [["x", "float32", [1] * 9]],
        [["", "float32", [1]]],
        [["x", "float32", [1]], ["x", "float32", [1]]],
        [["x", "float32", "abc"]],
    ],
)
def test_schema_from_wire_rejects_bad_input(fields):
    with pytest.raises(ProtocolError):
        Schema.from_wire(fields)


def test_field_spec_rejects_bool_dims():
    with pytest.raises(ProtocolError):
        FieldSpec("x", "float32", (True,))


def test_is_torch_and_cuda_visible_while_another_thread_is_still_importing_torch(monkeypatch):
    # A weights thread asking for torch arrays may be importing torch while the caller's
    # thread puts numpy steps: sys.modules then holds a torch module without Tensor yet.
    import types

    from rlink_ucx.session.actor.attach import cuda_visible
    from rlink_ucx.wire.codec import as_host_array, is_torch

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    step = np.arange(3, dtype=np.float32)
    assert is_torch(step) is False and cuda_visible() is False
    view, dtype = as_host_array(step)
    assert dtype == "float32" and view.tolist() == [0.0, 1.0, 2.0]

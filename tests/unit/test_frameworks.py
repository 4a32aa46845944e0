"""The framework adapters (wire/frameworks.py), nested params names (wire/manifest.py), numpy
bucket tags (weights/mac.py), and a kept batch of each format outliving later fetches."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from rlink_ucx import Actor, Config, ConfigError, Learner, ProtocolError, RLinkDataset
from rlink_ucx.weights import mac
from rlink_ucx.wire.frameworks import adapter, aligned, importable
from rlink_ucx.wire.manifest import flatten, unflatten

FORMATS = [
    pytest.param("torch", marks=pytest.mark.skipif(not importable("torch"), reason="torch not installed")),
    "numpy",
    pytest.param("jax", marks=pytest.mark.skipif(not importable("jax"), reason="jax not installed")),
    pytest.param("tensorflow", marks=pytest.mark.skipif(not importable("tensorflow"), reason="tensorflow not installed")),
]  # fmt: skip


def as_numpy(x):
    if type(x).__module__.startswith("torch"):
        return x.float().numpy() if str(x.dtype) == "torch.bfloat16" else x.numpy()
    return np.asarray(x)


def framework(x) -> str:
    root = type(x).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(root, root)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", FORMATS)
def test_adapter_hands_out_the_framework_s_arrays_with_their_values(fmt):
    a = adapter(fmt, "cpu")
    host = aligned((4 * 6,))
    host.view(np.float32)[:] = np.arange(6, dtype=np.float32)
    view = host.view(np.float32).reshape(2, 3)
    out = a.array(view, "float32")
    assert framework(out) == fmt and tuple(out.shape) == (2, 3)
    assert as_numpy(out).tolist() == [[0, 1, 2], [3, 4, 5]]
    # No copy on CPU (JAX: 64-byte aligned memory, which `aligned` gives): a write shows through.
    view[0, 0] = 42.0
    assert float(as_numpy(out)[0, 0]) == 42.0
    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # bfloat16 1.0 and -2.0
    bf = a.array(bits, "bfloat16")
    if "bfloat16" in str(bf.dtype):
        assert as_numpy(bf).astype(np.float32).tolist() == [1.0, -2.0]
    else:  # numpy without ml_dtypes: the bits
        assert fmt == "numpy" and bf.dtype == np.uint16 and bf.tolist() == [0x3F80, 0xC000]
    flags = np.array([True, False, True])
    assert as_numpy(a.array(flags, "bool")).tolist() == [True, False, True]
    empty = a.array(np.empty((5, 0), np.float32), "float32")
    assert tuple(empty.shape) == (5, 0)
    meta = a.array(np.array([7, 8], dtype=np.int64), "int64")
    assert framework(meta) == fmt and as_numpy(meta).tolist() == [7, 8]


@pytest.mark.timeout(30)
def test_unknown_format_or_device_is_a_config_error():
    with pytest.raises(ConfigError, match="format must be one of"):
        adapter("mxnet")
    with pytest.raises(ConfigError, match="device must be 'cpu'"):
        adapter("numpy", "cuda:0")
    if importable("jax"):
        with pytest.raises(ConfigError, match="no device 'cpu:7'"):
            adapter("jax", "cpu:7")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fmt", ["torch", "jax", "tensorflow"])
def test_a_framework_that_cannot_be_imported_is_a_config_error_naming_its_extra(fmt, monkeypatch):
    monkeypatch.setitem(sys.modules, fmt, None)  # import raises ImportError, as when not installed
    with pytest.raises(ConfigError, match=rf'pip install "rlink-ucx\[{fmt}\]"'):
        adapter(fmt)
    with Learner("127.0.0.1:0", insecure=True) as learner, pytest.raises(ConfigError, match=rf"rlink-ucx\[{fmt}\]"):
        RLinkDataset(learner, batch_size=4, format=fmt)


@pytest.mark.timeout(30)
def test_nested_names_round_trip_with_escapes():
    leaf = object()
    tree = {"params": {"Dense_0": {"kernel": 1, "bias": 2}, "a/b": {"~": 3}}, "step": leaf, "fc.weight": 4}
    flat = flatten(tree)
    assert flat == {"params/Dense_0/kernel": 1, "params/Dense_0/bias": 2, "params/a~1b/~0": 3, "step": leaf,
                    "fc.weight": 4}  # fmt: skip
    assert unflatten(flat) == tree
    with pytest.raises(ValueError, match="empty mapping"):
        flatten({"a": {}})
    with pytest.raises(ProtocolError, match="leaf"):
        unflatten({"a": 1, "a/b": 2})
    with pytest.raises(ProtocolError, match="leaf"):
        unflatten({"a/b": 1, "a": 2})
    with pytest.raises(ProtocolError, match="bad escape"):
        unflatten({"a~2": 1})


@pytest.mark.timeout(60)
@pytest.mark.skipif(not importable("torch"), reason="the reference tags need torch")
def test_numpy_tags_equal_torch_tags_bit_for_bit():
    import torch

    key = mac.VersionKey(bytes(range(32)))
    rng = np.random.default_rng(0)
    for n in (0, 1, 15, 16, 17, 4096, 3 * 4096 + 17, 300 * 4096 + 5):
        flat = rng.integers(0, 256, n + 64, dtype=np.uint8)
        tag = key.tag(flat, 64, 64 + n, 3, 1)
        assert key.tag(torch.from_numpy(flat), 64, 64 + n, 3, 1) == tag  # a tensor is read as its bytes
        assert key.tag(flat[64:].copy(), 0, n, 3, 1) != tag  # another place: another key


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch_size", [64, 48])  # a whole ring chunk (lent) and a copy into staging
def test_a_kept_batch_is_never_overwritten_by_later_fetches(fmt, batch_size):
    # A ring of a few batches, so later steps land where the kept batch's came from.
    config = Config(buffer_bytes=128 * 1024, frame_bytes=16 * 1024)
    with Learner("127.0.0.1:0", insecure=True, config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=batch_size, format=fmt)
        rounds = 40
        with Actor(f"127.0.0.1:{learner.port}", insecure=True, transport="tcp") as actor:
            x = np.arange(batch_size * rounds, dtype=np.float32)[:, None] * np.ones(64, np.float32)
            actor.put_many({"x": x[:batch_size]})
            kept = dataset.fetch(timeout=30)
            first = as_numpy(kept["x"]).copy()
            later = []
            for r in range(1, rounds):
                actor.put_many({"x": x[r * batch_size : (r + 1) * batch_size]})
                later.append(as_numpy(dataset.fetch(timeout=30)["x"])[:, 0].tolist())
        assert first[:, 0].tolist() == list(range(batch_size))
        assert as_numpy(kept["x"]).tolist() == first.tolist()
        assert as_numpy(kept.seq).tolist() == list(range(batch_size))
        assert later[-1] == list(range((rounds - 1) * batch_size, rounds * batch_size))
        dataset.close()

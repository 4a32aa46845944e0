"""Keyed bucket tags (weights/mac.py) and the weights keys (wire/keys.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlink_ucx import ProtocolError
from rlink_ucx.weights import snapshot as _snapshot
from rlink_ucx.wire import manifest as _manifest

pytestmark = pytest.mark.timeout(60)


def reference_rows(data: bytes, key) -> bytes:
    """The definition, in Python integers: per row of ROW signed bytes (the last zero-padded),
    its dot product with each column of the key matrix, as little-endian int32."""
    from rlink_ucx.weights import mac

    data += bytes(-len(data) % mac.ROW)
    out = b""
    columns = key.rows.T.tolist()
    for r in range(0, len(data), mac.ROW):
        row = np.frombuffer(data[r : r + mac.ROW], dtype=np.int8).tolist()
        for column in columns:
            out += sum(b * k for b, k in zip(row, column)).to_bytes(4, "little", signed=True)
    return out


@pytest.mark.parametrize("start, size", [(0, 2 * 4096), (64, 4096 + 100), (3, 4096 * 2 + 5), (128, 7), (0, 0)])
def test_row_hashes_follow_their_definition_on_the_host_and_as_a_device_computes_them(start, size):
    from rlink_ucx.weights import mac

    rng = np.random.default_rng(start + size)
    flat = rng.integers(0, 256, size=start + size + 64, dtype=np.uint8)
    flat[start : start + 50] = 255  # the extremes: -1 as signed bytes, and keys reach -128
    key = mac.VersionKey()
    expected = reference_rows(flat[start : start + size].tobytes(), key)
    assert mac.row_hashes(flat, start, start + size, key) == expected  # int8 products
    # What a device computes (float64, exact here), on a torch buffer.
    assert mac.row_hashes(torch.from_numpy(flat), start, start + size, key, exact_float=True) == expected


def test_every_single_bit_change_alters_the_tag():
    from rlink_ucx.weights import mac

    rng = np.random.default_rng(7)
    flat = rng.integers(0, 256, size=3 * 4096 + 17, dtype=np.uint8)
    key = mac.VersionKey()
    tag = key.tag(flat, 0, len(flat), 1, 0)
    for where in rng.integers(0, len(flat), size=200):
        altered = flat.copy()
        altered[where] ^= np.uint8(1 << int(rng.integers(0, 8)))
        assert key.tag(altered, 0, len(flat), 1, 0) != tag, where
    # The same bytes under another key, version or place get another tag.
    assert mac.VersionKey().tag(flat, 0, len(flat), 1, 0) != tag
    assert key.tag(flat, 0, len(flat), 2, 0) != tag and key.tag(flat, 0, len(flat), 1, 1) != tag
    assert key.tag(flat, 0, len(flat), 1, 0) == tag and len(tag) == 16


def device_labelled_snapshot(state: dict) -> _snapshot.Snapshot:
    """A snapshot taking the CUDA code path (a torch buffer labelled as a device's)."""
    entries, total = _snapshot.layout(state)
    kind = getattr(_manifest, "KEYED", "sum64")
    snap = _snapshot.Snapshot(_manifest.Manifest(1, entries, total, 4096, [], kind),
                              torch.zeros(total, dtype=torch.uint8), "cuda:0", sealed=False)  # fmt: skip
    _snapshot.fill(snap, _snapshot.sources(snap, state))
    return snap


def test_a_device_bucket_altered_with_its_word_sum_kept_is_caught():
    """A wrapped sum of 64-bit words (the old device checksum) stays the same when two words
    swap places, or when one grows by what another loses; the keyed tag does not."""
    snap = device_labelled_snapshot({"w": torch.arange(2048, dtype=torch.float32)})
    snap.verify()
    words = snap.flat[:4096].view(torch.int64)
    words[[3, 40]] = words[[40, 3]].clone()  # swap two words of bucket 0
    with pytest.raises(ProtocolError, match="bucket 0"):
        snap.verify()
    words[[3, 40]] = words[[40, 3]].clone()
    snap.verify()
    words[5] += 1 << 20
    words[6] -= 1 << 20
    with pytest.raises(ProtocolError, match="bucket 0"):
        snap.verify()


def test_a_host_copy_of_a_device_snapshot_keeps_its_tags():
    state = {"w": torch.randn(3000), "b": torch.arange(5)}
    device = device_labelled_snapshot(state)
    host = _snapshot.Snapshot(device.manifest, device.flat.numpy().copy(), "cpu", key=device.key, tags=device.tags)
    host.verify()  # numpy on the host agrees with torch on the "device"
    assert host.tags == device.key.tags(host.flat, host.manifest.buckets(), 1)


def test_a_wrapped_key_opens_only_with_its_key_and_the_seal_binds_everything():
    import msgspec

    from rlink_ucx.wire import keys

    manifest = _snapshot.snapshot({"w": torch.ones(100)}, 4, 256, _snapshot.BufferPool()).manifest
    session = keys.session_key(b"t" * 32, b"ticket" * 5, 7)
    assert session != keys.session_key(b"u" * 32, b"ticket" * 5, 7)  # the token matters
    assert session != keys.session_key(b"t" * 32, b"ticket" * 5, 8)
    sub = keys.subscription_key(session, b"n" * 32)
    secret = bytes(range(32))
    wrapped = keys.wrap(sub, 4, secret)
    assert wrapped != secret and keys.wrap(sub, 4, wrapped) == secret
    assert keys.wrap(keys.subscription_key(session, b"m" * 32), 4, wrapped) != secret
    assert keys.wrap(sub, 5, wrapped) != secret  # one pad per version
    tags = [b"a" * 16, b"b" * 16]
    mac_ = keys.seal_mac(sub, 4, manifest, wrapped, tags)
    assert keys.seal_mac(sub, 4, manifest, wrapped, list(reversed(tags))) != mac_
    assert keys.seal_mac(sub, 4, manifest, keys.wrap(sub, 4, bytes(32)), tags) != mac_
    renamed = msgspec.structs.replace(manifest, entries=[msgspec.structs.replace(manifest.entries[0], name="v")])
    assert keys.seal_mac(sub, 4, renamed, wrapped, tags) != mac_
    assert keys.seal_mac(sub, 5, manifest, wrapped, tags) != mac_
    assert keys.seal_mac(sub, 4, manifest, wrapped, tags) == mac_
    # Pull proofs: each side's differs, and both cover both nonces.
    a = keys.pull_proof(session, "actor", b"L" * 32, b"A" * 32, 7)
    assert a != keys.pull_proof(session, "learner", b"L" * 32, b"A" * 32, 7)
    assert a != keys.pull_proof(session, "actor", b"L" * 32, b"B" * 32, 7)

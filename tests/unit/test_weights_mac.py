"""Bucket tags (AES-GMAC under one-time keys, weights/mac.py) and the weights keys (wire/keys.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlink_ucx import ProtocolError
from rlink_ucx.weights import snapshot as _snapshot
from rlink_ucx.wire import manifest as _manifest

pytestmark = pytest.mark.timeout(60)


def test_the_tag_is_standard_aes_256_gmac():
    """GMAC is AES-GCM with nothing to encrypt: McGrew and Viega's GCM test case 13 (AES-256,
    zero key and nonce, nothing at all), and pyca's one-shot AEAD over the same bytes."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from rlink_ucx.weights import mac

    assert mac.BucketTagger(bytes(32), bytes(12)).finalize().hex() == "530f8afbc74536b9a963b4f1c4cb738b"
    key = mac.VersionKey(bytes(range(32)))
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    aes, nonce = key.bucket_key(5, 2, 64, 10_064)
    assert len(aes) == 32 and len(nonce) == 12
    assert key.tag(data, 0, len(data), 5, 2) != AESGCM(aes).encrypt(nonce, b"", data.tobytes())  # place 0:10000
    whole = np.concatenate([np.zeros(64, dtype=np.uint8), data])
    assert key.tag(whole, 64, 10_064, 5, 2) == AESGCM(aes).encrypt(nonce, b"", data.tobytes())


@pytest.mark.parametrize("cuts", [[], [1], [15, 16, 17], [4096, 4097], [3, 5000, 9999]])
def test_a_bucket_tagged_piece_by_piece_has_its_whole_tag(cuts):
    from rlink_ucx.weights import mac

    data = np.random.default_rng(len(cuts)).integers(0, 256, 10_000, dtype=np.uint8)
    key = mac.VersionKey()
    tagger = key.tagger(0, len(data), 1, 0)
    for a, b in zip([0, *cuts], [*cuts, len(data)]):
        tagger.update(data[a:b])
    assert tagger.finalize() == key.tag(data, 0, len(data), 1, 0)


def test_one_flipped_byte_anywhere_fails_and_so_does_another_place_or_length():
    from rlink_ucx.weights import mac

    rng = np.random.default_rng(7)
    flat = rng.integers(0, 256, size=3 * 4096 + 17, dtype=np.uint8)
    key = mac.VersionKey()
    n = len(flat)
    tag = key.tag(flat, 0, n, 1, 0)
    edges = [0, 1, 15, 16, 17, 63, 64, 4095, 4096, n - 17, n - 2, n - 1]  # first, last, GHASH blocks' edges
    for where in [*edges, *rng.integers(0, n, size=100).tolist()]:
        for bit in (0, 7):
            altered = flat.copy()
            altered[where] ^= np.uint8(1 << bit)
            assert key.tag(altered, 0, n, 1, 0) != tag, (where, bit)
    # The same bytes under another key, version, index or range, or one byte fewer or more.
    assert mac.VersionKey().tag(flat, 0, n, 1, 0) != tag
    assert key.tag(flat, 0, n, 2, 0) != tag and key.tag(flat, 0, n, 1, 1) != tag
    padded = np.concatenate([flat, np.zeros(15, dtype=np.uint8)])  # zero padding to a whole GHASH block
    assert key.tag(padded, 0, n + 15, 1, 0) != tag and key.tag(padded, 0, n, 1, 0) == tag
    tagger = key.tagger(0, n, 1, 0)  # the place's key over the bytes zero-padded: the length is bound too
    tagger.update(padded)
    assert tagger.finalize() != tag
    assert key.tag(flat, 0, n - 1, 1, 0) != tag and key.tag(flat, 1, n, 1, 0) != tag
    assert key.tag(flat, 0, n, 1, 0) == tag and len(tag) == mac.TAG_BYTES == 16


def test_tags_differ_across_versions_and_places_and_no_key_serves_two_places():
    from rlink_ucx.weights import mac

    key = mac.VersionKey()
    data = np.zeros(1 << 16, dtype=np.uint8)  # the same bytes in every bucket
    step = 4096
    buckets = [(a, a + step) for a in range(0, len(data), step)]
    keys, tags = set(), set()
    for version in (1, 2, 3):
        for i, (a, b) in enumerate(buckets):
            keys.add(key.bucket_key(version, i, a, b)[0])
            tags.add(key.tag(data, a, b, version, i))
    # Places sharing all but one field of (version, index, start, stop).
    for place in [(1, 0, 0, 4097), (1, 0, 1, 4096), (1, 1, 0, 4096), (1, 2**63, 0, 4096), (2**64 - 1, 0, 0, 4096)]:
        keys.add(key.bucket_key(*place)[0])
    assert len(keys) == 3 * len(buckets) + 5 and len(tags) == 3 * len(buckets)
    # Another version's secret derives other keys for the same places.
    assert not keys & {mac.VersionKey().bucket_key(1, i, a, b)[0] for i, (a, b) in enumerate(buckets)}
    assert key.tags(data, buckets, 1) == [key.tag(data, a, b, 1, i) for i, (a, b) in enumerate(buckets)]


def test_a_large_model_is_tagged_on_threads_that_end_with_the_call(monkeypatch):
    import threading

    from rlink_ucx.weights import mac

    monkeypatch.setattr(mac, "_PARALLEL_BYTES", 1 << 20)
    data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    buckets = [(a, min(a + 300_000, len(data))) for a in range(0, len(data), 300_000)]
    key = mac.VersionKey()
    names = set()
    original = mac.VersionKey._tag_host

    def recording(self, *args):
        names.add(threading.current_thread().name)
        return original(self, *args)

    monkeypatch.setattr(mac.VersionKey, "_tag_host", recording)
    parallel = key.tags(data, buckets, 9)
    monkeypatch.setattr(mac.VersionKey, "_tag_host", original)
    assert parallel == [key.tag(data, a, b, 9, i) for i, (a, b) in enumerate(buckets)]
    if len(os.sched_getaffinity(0)) > 1:
        assert names and all(n.startswith("rlink-tags") for n in names), names
    else:
        assert names == {threading.current_thread().name}
    assert not [t for t in threading.enumerate() if t.name.startswith("rlink-tags")]


def test_tagging_needs_no_torch():
    """A numpy-only process snapshots, tags and verifies a version without importing torch."""
    code = ("import sys, numpy as np\n"
            "from rlink_ucx.weights import snapshot as s\n"
            "snap = s.snapshot({'w': np.arange(5000, dtype=np.float32)}, 1, 4096, s.BufferPool())\n"
            "snap.verify()\n"
            "assert len(snap.tags) == 5 and 'torch' not in sys.modules, sorted(sys.modules)\n"
            "print('ok')\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def device_labelled_snapshot(state: dict) -> _snapshot.Snapshot:
    """A snapshot taking the CUDA code path (a torch buffer labelled as a device's)."""
    entries, total = _snapshot.layout(state)
    snap = _snapshot.Snapshot(_manifest.Manifest(1, entries, total, 4096, [], _manifest.KEYED),
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


def test_a_device_snapshot_is_tagged_on_the_host_copy_it_keeps():
    state = {"w": torch.randn(3000), "b": torch.arange(5)}
    device = device_labelled_snapshot(state)
    host = device.host
    assert host is not None and host.device == "cpu" and isinstance(host.flat, np.ndarray)
    assert np.array_equal(host.flat, device.flat.numpy()) and host.tags == device.tags and host.key is device.key
    host.verify()
    device.verify()  # the device buffer read through its tensor gives the same tags
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
    # Weights stream proofs: each side's differs, and both cover both nonces.
    a = keys.stream_proof(session, "actor", b"L" * 32, b"A" * 32, 7)
    assert a != keys.stream_proof(session, "learner", b"L" * 32, b"A" * 32, 7)
    assert a != keys.stream_proof(session, "actor", b"L" * 32, b"B" * 32, 7)

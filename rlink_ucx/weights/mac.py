"""Keyed tags of weights buckets: AES-256-GMAC under a one-time key per bucket.

Every bucket of a version has its own AES-256 key and GCM nonce, derived from the version's
secret (32 random bytes, fresh for every published version) with keyed BLAKE2b, a PRF, over the
bucket's place: (version, index, start, stop). Its tag is GMAC (NIST SP 800-38D): AES-GCM with
the bucket's bytes as associated data and nothing to encrypt, all 16 bytes of it, computed by
OpenSSL through pyca/cryptography.

- One key, one message: the learner tags each place of a version once, and a key is never used
  for another place (another index, range or version), so no two messages share a GHASH key
  or a nonce, which is what GCM's authentication needs. A receiver recomputes the tag over the
  bytes it got to compare; it tells nobody what it computed.
- Forgery: without the secret, bytes other than the published ones pass a bucket's tag with
  probability at most (ceil(L/16) + 1) / 2**128 per try for a bucket of L bytes, given the
  one tag an attacker may have seen (GHASH is a polynomial of that degree in a key no one
  else knows), plus the advantage of breaking AES or BLAKE2b as PRFs.
- The length and place are bound: GHASH ends with the length of what it covered, and another
  place has another key.

OpenSSL's GCM uses AES-NI and carry-less multiplication (PCLMULQDQ; VAES and VPCLMULQDQ where
the CPU has them), not the integer dot products that VNNI speeds up, and it releases the GIL:
one core tags many GB/s (docs/benchmarks.md), and :meth:`VersionKey.tags` tags a large model's
buckets on several threads. The same code runs with or without torch: a torch tensor is read
through its own ``cpu()`` and ``numpy()`` (a CUDA buffer is tagged from a host copy), so a
numpy, JAX or TensorFlow process never imports torch here.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import os
import secrets
import struct
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ..errors import ProtocolError
from ..wire.keys import KEY_BYTES

__all__ = ["TAG_BYTES", "BucketTagger", "VersionKey", "check_tags", "host_bytes"]

TAG_BYTES = 16  # GCM's full tag
_NONCE_BYTES = 12  # GCM's standard nonce
_PLACE = struct.Struct("<QQQQ")  # version, index, start, stop
_KDF_PERSON = b"rlink gmac key"  # BLAKE2b's personalisation: these derived keys and nothing else
_PARALLEL_BYTES = 64 << 20  # below this one thread tags a model in a few ms; threads cost more
_MAX_THREADS = 4


class BucketTagger:
    """The GMAC of one bucket, fed piece by piece: :meth:`update` with consecutive pieces of the
    bucket's bytes (any sizes), then :meth:`finalize` once for the tag. Made by
    :meth:`VersionKey.tagger`; the tag equals :meth:`VersionKey.tag` of the whole bucket."""

    __slots__ = ("_gcm",)

    def __init__(self, key: bytes, nonce: bytes):
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()

    def update(self, data: Any) -> None:
        """Add the next piece of the bucket (a contiguous bytes-like object or numpy array)."""
        self._gcm.authenticate_additional_data(data)

    def finalize(self) -> bytes:
        """The bucket's 16-byte tag (once: the tagger cannot be used after)."""
        self._gcm.finalize()
        tag: bytes = self._gcm.tag
        return tag


class VersionKey:
    """The secret of one model version, from which each bucket's one-time GMAC key is derived.
    A fresh one is drawn for every published version; a receiver builds it from the secret it
    was sent (wrapped under its own key, ``wire/keys.py``)."""

    __slots__ = ("secret",)

    def __init__(self, secret: bytes | None = None):
        self.secret = secrets.token_bytes(KEY_BYTES) if secret is None else bytes(secret)
        if len(self.secret) != KEY_BYTES:
            raise ProtocolError(f"a weights key has {KEY_BYTES} bytes, not {len(self.secret)}")

    def bucket_key(self, version: int, index: int, start: int, stop: int) -> tuple[bytes, bytes]:
        """The AES-256 key and GCM nonce of bucket ``index`` (bytes ``start:stop``) of
        ``version``: BLAKE2b keyed with the secret over the place, so each place has its own."""
        derived = hashlib.blake2b(_PLACE.pack(version, index, start, stop), key=self.secret,
                                  digest_size=32 + _NONCE_BYTES, person=_KDF_PERSON).digest()  # fmt: skip
        return derived[:32], derived[32:]

    def tagger(self, start: int, stop: int, version: int, index: int) -> BucketTagger:
        """An incremental tagger of bucket ``index`` (bytes ``start:stop``) of ``version``."""
        return BucketTagger(*self.bucket_key(version, index, start, stop))

    def tag(self, flat: Any, start: int, stop: int, version: int, index: int) -> bytes:
        """The tag of bucket ``index`` (bytes ``start:stop`` of ``flat``, a host ``np.uint8``
        array or a torch ``uint8`` tensor on any device) of ``version``."""
        return self._tag_host(host_bytes(flat, start, stop), start, stop, version, index)

    def tags(self, flat: Any, buckets: list[tuple[int, int]], version: int) -> list[bytes]:
        """Every bucket's tag, in order. A model of at least 64 MiB in several buckets is tagged
        on up to 4 threads (OpenSSL releases the GIL); the threads end before this returns."""
        total = buckets[-1][1] - buckets[0][0] if buckets else 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = min(_MAX_THREADS, len(buckets), cores)
        if total < _PARALLEL_BYTES or threads < 2:
            return [self.tag(flat, a, b, version, i) for i, (a, b) in enumerate(buckets)]
        host = host_bytes(flat, buckets[0][0], buckets[-1][1])  # one copy of a device buffer
        base = buckets[0][0]
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="rlink-tags") as pool:
            futures = [pool.submit(self._tag_host, host[a - base : b - base], a, b, version, i)
                       for i, (a, b) in enumerate(buckets)]  # fmt: skip
            return [f.result() for f in futures]

    def _tag_host(self, data: np.ndarray, start: int, stop: int, version: int, index: int) -> bytes:
        tagger = self.tagger(start, stop, version, index)
        tagger.update(data)
        return tagger.finalize()


def host_bytes(flat: Any, start: int, stop: int) -> np.ndarray:
    """Bytes ``start:stop`` of ``flat`` as a contiguous host ``np.uint8`` array: a view of a
    host array or CPU tensor, a copy of a device tensor's. Torch is never imported here: a
    tensor's own methods read it."""
    if isinstance(flat, np.ndarray):
        return np.ascontiguousarray(flat[start:stop])
    array: np.ndarray = flat[start:stop].cpu().numpy()  # ``cpu()`` returns a CPU tensor itself
    return np.ascontiguousarray(array)


def check_tags(expected: list[bytes], got: list[bytes], version: int) -> None:
    """Raise ProtocolError naming the buckets whose tags differ (compared in constant time)."""
    if len(expected) != len(got):
        raise ProtocolError(f"weights version {version}: {len(expected)} tags for {len(got)} buckets")
    bad = [i for i, (a, b) in enumerate(zip(expected, got)) if not hmac.compare_digest(a, b)]
    if bad:
        raise ProtocolError(f"weights version {version}: buckets {bad[:10]} failed their MAC (altered on the way)")

"""Model weights as one flat, versioned, checksummed byte buffer: no pickle, ever.

A state dict is laid out tensor after tensor (64-byte aligned) in one ``uint8`` buffer. The
:class:`Manifest` says where each tensor lives, and carries one checksum per *bucket* (a
fixed-size byte range; the fan-out moves one bucket per collective). A receiver validates the
manifest before allocating anything, and verifies every bucket before exposing the version.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import xxhash

from ..errors import ProtocolError, RLinkError
from ..wire.codec import DTYPES
from ..wire.manifest import ALIGN, Entry, Manifest

__all__ = ["Snapshot", "BufferPool", "snapshot", "state_dict_of"]

def _np(t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes (numpy copies are much faster than torch's here)."""
    import torch

    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _dtype_name(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise RLinkError(f"cannot publish a {t.dtype} tensor; allowed dtypes: {sorted(DTYPES)}")
    return name


def state_dict_of(obj: Any) -> Mapping[str, Any]:
    """The tensors to publish: a module's ``state_dict()``, or a mapping of name -> tensor."""
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"publish() takes a torch.nn.Module or a state dict, not {type(obj).__name__}")
    for name, t in obj.items():
        if not hasattr(t, "dtype") or not hasattr(t, "shape"):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
    return obj


def layout(state: Mapping[str, Any]) -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for name, t in state.items():
        offset = -(-offset // ALIGN) * ALIGN
        e = Entry(str(name), _dtype_name(t), [int(d) for d in t.shape], offset)
        entries.append(e)
        offset += e.nbytes()
    return entries, offset


def checksum(flat: Any, start: int, stop: int, kind: str) -> int:
    """One bucket's checksum: XXH3-64 of host bytes (~13 GB/s here, 5x crc32), or for a CUDA
    buffer the wrapped sum of its int64 words computed on the GPU (no host copy)."""
    if kind == "xxh3":
        return int(xxhash.xxh3_64_intdigest(memoryview(flat)[start:stop]))
    import torch

    body = (stop - start) // 8 * 8
    total = flat[start : start + body].view(torch.int64).sum() if body else torch.zeros((), dtype=torch.int64)
    if stop > start + body:
        total = total + flat[start + body : stop].to(torch.int64).sum()
    return int(total) & (2**64 - 1)


def checksums(flat: Any, buckets: list[tuple[int, int]], kind: str) -> list[int]:
    return [checksum(flat, a, b, kind) for a, b in buckets]


class Snapshot:
    """One version: the flat buffer (host ``np.uint8`` or a CUDA ``torch.uint8`` tensor) and its
    manifest. A snapshot being written (:func:`begin_snapshot`) becomes readable bucket by
    bucket, so the fan-out can send bucket 0 while later ones are still being copied."""

    __slots__ = ("manifest", "flat", "device", "host", "ready", "sealed", "_cv")

    def __init__(self, manifest: Manifest, flat: Any, device: str, *, sealed: bool = True):
        self.manifest, self.flat, self.device = manifest, flat, device
        self.host: Snapshot | None = None  # a CUDA snapshot's host copy, made on demand
        self.sealed = sealed  # every bucket copied and the checksums in the manifest
        self.ready = len(manifest.buckets()) if sealed else 0  # buckets copied so far
        self._cv = threading.Condition()

    @property
    def version(self) -> int:
        return self.manifest.version

    def bucket(self, start: int, stop: int) -> Any:
        """A torch view of one bucket, for a collective."""
        import torch

        if isinstance(self.flat, np.ndarray):
            return torch.from_numpy(self.flat[start:stop])
        return self.flat[start:stop]

    def wait_ready(self, buckets: int, timeout: float) -> None:
        """Until the first ``buckets`` buckets are copied (``len(buckets())`` + 1: sealed)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.ready >= buckets or self.sealed, timeout):
                raise RLinkError(f"weights version {self.version}: snapshot not written within {timeout:.3g}s")

    def verify(self, index: int | None = None) -> None:
        """Check one bucket (or all) against the manifest."""
        buckets = self.manifest.buckets()
        for i in range(len(buckets)) if index is None else (index,):
            if checksum(self.flat, *buckets[i], self.manifest.checksum) != self.manifest.checksums[i]:
                raise ProtocolError(f"weights version {self.version}: bucket {i} checksum mismatch")

    def tensors(self) -> dict[str, Any]:
        """Zero-copy torch views of every tensor, keyed by name."""
        import torch

        from ..wire.codec import torch_dtype

        out = {}
        for e in self.manifest.entries:
            n = e.nbytes()
            if isinstance(self.flat, np.ndarray):
                raw = self.flat[e.offset : e.offset + n]
                arr = raw.view(DTYPES[e.dtype]).reshape(e.shape)
                t = torch.from_numpy(arr)
                if e.dtype == "bfloat16":
                    t = t.view(torch.bfloat16)
            else:
                t = self.flat[e.offset : e.offset + n].view(torch_dtype(e.dtype)).view(e.shape)
            out[e.name] = t
        return out


class BufferPool:
    """Reuses flat buffers nobody references any more; a buffer still referenced (a state dict
    the caller kept, a fan-out in flight) is never overwritten."""

    def __init__(self, keep: int = 2):
        self._free: list[np.ndarray] = []
        self._out: list[np.ndarray] = []
        self._keep = keep

    def get(self, nbytes: int) -> np.ndarray:
        still = []
        for buf in self._out:
            # Views made from the buffer (numpy slices, tensors from them) reference it; 3 = the
            # list slot, the loop variable and getrefcount's own argument.
            if sys.getrefcount(buf) > 3:
                still.append(buf)
            elif len(self._free) < self._keep:
                self._free.append(buf)
        self._out = still
        for i, buf in enumerate(self._free):
            if buf.nbytes == nbytes:
                del self._free[i]
                break
        else:
            buf = np.empty(nbytes, dtype=np.uint8)
        self._out.append(buf)
        return buf


def begin_snapshot(state: Mapping[str, Any], version: int, bucket_bytes: int, pool: BufferPool) -> Snapshot:
    """An empty snapshot laid out for ``state`` (every dtype checked); fill it with :func:`fill`."""
    entries, total = layout(state)
    devices = {str(t.device) for t in state.values()}
    if len(devices) == 1 and next(iter(devices)).startswith("cuda"):
        import torch

        flat, kind, device = torch.empty(total, dtype=torch.uint8, device=next(iter(devices))), "sum64", next(iter(devices))
    else:
        flat, kind, device = pool.get(total), "xxh3", "cpu"
    manifest = Manifest(version, entries, total, max(ALIGN, bucket_bytes), [], kind)
    return Snapshot(manifest, flat, device, sealed=False)


def fill(snap: Snapshot, state: Mapping[str, Any]) -> None:
    """Copy ``state`` into ``snap`` in bucket-sized pieces; each bucket is checksummed and
    released to readers as soon as it is complete; finally the snapshot is sealed."""
    buckets = snap.manifest.buckets()
    sums: list[int] = []

    def release_upto(done: int) -> None:
        while len(sums) < len(buckets) and buckets[len(sums)][1] <= done:
            sums.append(checksum(snap.flat, *buckets[len(sums)], snap.manifest.checksum))
            with snap._cv:
                snap.ready = len(sums)
                snap._cv.notify_all()

    on_device = not isinstance(snap.flat, np.ndarray)
    for e, t in zip(snap.manifest.entries, state.values()):
        if on_device:
            src = t.detach().contiguous().reshape(-1).view(snap.flat.dtype)
        else:
            src = _np(t.cpu()).reshape(-1).view(np.uint8)  # reshape copies only a non-contiguous tensor
        at = 0
        while at < len(src):
            stop = min(len(src), (e.offset + at) // snap.manifest.bucket_bytes * snap.manifest.bucket_bytes
                       + snap.manifest.bucket_bytes - e.offset)  # fmt: skip
            snap.flat[e.offset + at : e.offset + stop] = src[at:stop]
            at = stop
            release_upto(e.offset + at)
    release_upto(snap.manifest.total_bytes)
    with snap._cv:
        snap.manifest = msgspec.structs.replace(snap.manifest, checksums=sums)
        snap.sealed = True
        snap._cv.notify_all()


def snapshot(state: Mapping[str, Any], version: int, bucket_bytes: int, pool: BufferPool) -> Snapshot:
    """Copy ``state`` into a flat buffer (so training may go on at once) and checksum it."""
    snap = begin_snapshot(state, version, bucket_bytes, pool)
    fill(snap, state)
    return snap

"""Model weights as one flat, versioned byte buffer with a keyed tag per bucket: no pickle, ever.

A state dict is laid out tensor after tensor (64-byte aligned) in one ``uint8`` buffer. The
:class:`Manifest` says where each tensor lives; every *bucket* (a fixed-size byte range; a
weights stream sends each one as soon as it is copied) gets a tag keyed with the version's own
secret (``mac.py``). A receiver validates the manifest before allocating anything, and checks
every bucket's tag before exposing the version.
"""

from __future__ import annotations

import hmac
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, ProtocolError, RLinkError
from ..wire.codec import DTYPES, MAX_NAME_LEN, host_array, is_torch
from ..wire.frameworks import Adapter
from ..wire.manifest import ALIGN, KEYED, Entry, Manifest, flatten
from .mac import VersionKey, host_bytes
from .shared import SharedBuffer
from .shared import available as shared_available
from .unwrap import module_state_dict

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool", "Snapshot", "snapshot", "state_dict_of"]

def _np(t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes (numpy copies are much faster than torch's here)."""
    import torch

    t = t.detach()
    array: np.ndarray = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return array


def _dtype_name(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    name = "bool" if name == "bool_" else name
    if name not in DTYPES:
        raise RLinkError(f"cannot publish a {t.dtype} tensor; allowed dtypes: {sorted(DTYPES)}")
    return name


def state_dict_of(obj: Any) -> Mapping[str, Any]:
    """The arrays to publish, by name: a module's ``state_dict()``, a flat mapping of name ->
    tensor, or a nested mapping (a pytree of dicts, as flax keeps params) whose leaves are arrays
    of any framework (torch, numpy, JAX, TensorFlow: anything with ``__dlpack__`` or the array
    interface). Nested names are paths (``wire.manifest.flatten``). Torch tensors stay as they are
    (a CUDA state dict is copied on its GPU); other arrays become host numpy arrays here. A
    DDP / FSDP / ``torch.compile`` wrapped module gives the inner module's names (``unwrap.py``)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        obj = module_state_dict(obj)
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise TypeError(f"publish() takes a torch.nn.Module or a (nested) mapping of arrays, not {type(obj).__name__}")
    try:
        flat = flatten(obj)
    except ConfigError:
        raise
    except ValueError as exc:
        raise TypeError(f"publish(): {exc}") from None
    out: dict[str, Any] = {}
    for name, t in flat.items():
        if not name or len(name) > 4 * MAX_NAME_LEN:
            raise TypeError(f"params entry {name[:60]!r}: a name (a path, nested) of 1 to {4 * MAX_NAME_LEN} characters")
        if is_torch(t):
            out[name] = t
            continue
        if not hasattr(t, "__dlpack__") and not hasattr(t, "__array_interface__") and not hasattr(t, "__array__"):
            raise TypeError(f"params entry {name!r} is a {type(t).__name__}, not an array or tensor")
        try:
            out[name] = host_array(t)
        except Exception as exc:
            raise TypeError(f"params entry {name!r} ({type(t).__name__}) cannot be read as an array: {exc}") from exc
    return out


def layout(state: Mapping[str, Any]) -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for name, t in state.items():
        offset = -(-offset // ALIGN) * ALIGN
        e = Entry(str(name), _dtype_name(t), [int(d) for d in t.shape], offset)
        entries.append(e)
        offset += e.nbytes()
    return entries, offset


class Snapshot:
    """One version: the flat buffer (host ``np.uint8`` or a CUDA ``torch.uint8`` tensor), its
    manifest, its key and its bucket tags. A snapshot being written (:func:`begin_snapshot`)
    becomes readable bucket by bucket, so the fan-out can send bucket 0 while later ones are
    still being copied; it is *sealed* once every bucket's tag is computed."""

    __slots__ = ("_cv", "device", "failed", "flat", "host", "key", "manifest", "ready", "sealed", "shared", "tags")

    def __init__(self, manifest: Manifest, flat: Any, device: str, *, sealed: bool = True,
                 key: VersionKey | None = None, tags: list[bytes] | None = None):  # fmt: skip
        self.manifest, self.flat, self.device = manifest, flat, device
        self.host: Snapshot | None = None  # a CUDA snapshot's host copy, made on demand
        self.shared: list[Any] | None = None  # where actors on this host read ``flat`` (shared.py)
        self.key = key if key is not None else VersionKey()
        self.tags: list[bytes] = tags if tags is not None else []
        if sealed and tags is None:
            self.tags = self.key.tags(flat, manifest.buckets(), manifest.version)
        self.sealed = sealed  # every bucket copied and tagged
        self.ready = len(manifest.buckets()) if sealed else 0  # buckets copied so far
        self.failed: BaseException | None = None  # why writing it stopped half-way (abandon)
        self._cv = threading.Condition()

    @property
    def version(self) -> int:
        return self.manifest.version

    def wait_ready(self, buckets: int, timeout: float) -> None:
        """Until the first ``buckets`` buckets are copied (``len(buckets())`` + 1: sealed)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.ready >= buckets or self.sealed or self.failed, timeout):
                raise RLinkError(f"weights version {self.version}: snapshot not written within {timeout:.3g}s")
            if self.failed is not None and not self.sealed and self.ready < buckets:
                raise RLinkError(f"weights version {self.version}: its publish failed: {self.failed!r}")

    def abandon(self, exc: BaseException) -> None:
        """Writing stopped half-way: whoever waits for a bucket not written raises at once."""
        with self._cv:
            self.failed = exc
            self._cv.notify_all()

    def verify(self, index: int | None = None) -> None:
        """Check one bucket (or all) against its tag; ProtocolError names a bucket that differs."""
        buckets = self.manifest.buckets()
        for i in range(len(buckets)) if index is None else (index,):
            if i >= len(self.tags) or not hmac.compare_digest(self.key.tag(self.flat, *buckets[i], self.version, i),
                                                               self.tags[i]):  # fmt: skip
                raise ProtocolError(f"weights version {self.version}: bucket {i} failed its MAC (altered?)")

    def arrays(self, adapter: Adapter) -> dict[str, Any]:
        """Every tensor as an array of ``adapter``'s framework, keyed by name: views of a host
        buffer where the framework takes them (``wire/frameworks.py``); a CUDA buffer for
        another framework is copied to the host first."""
        if not isinstance(self.flat, np.ndarray):
            if adapter.format == "torch":
                return self.tensors()
            flat = self.flat.cpu().numpy()
        else:
            flat = self.flat
        return {e.name: adapter.array(flat[e.offset : e.offset + e.nbytes()].view(DTYPES[e.dtype]).reshape(e.shape),
                                      e.dtype) for e in self.manifest.entries}  # fmt: skip

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
    the caller kept, a fan-out in flight) is never overwritten. ``shared``: buffers live in
    shared memory that actors on this host can read (``shared.py``)."""

    def __init__(self, keep: int = 2, shared: bool = False):
        self._free: list[tuple[np.ndarray, SharedBuffer | None]] = []
        self._out: list[tuple[np.ndarray, SharedBuffer | None]] = []
        self._keep = keep
        self.shared = shared and shared_available()

    def get(self, nbytes: int) -> tuple[np.ndarray, list[Any] | None]:
        """A buffer of ``nbytes`` and, for a shared one, where actors find it."""
        still = []
        for entry in self._out:
            buf = entry[0]
            # Views made from the buffer (numpy slices, tensors from them) reference it; 3 = the
            # tuple's slot, ``buf`` and getrefcount's own argument.
            if sys.getrefcount(buf) > 3:
                still.append(entry)
            elif len(self._free) < self._keep:
                self._free.append(entry)
            elif entry[1] is not None:
                entry[1].close()
            del buf
        self._out = still
        for i, entry in enumerate(self._free):
            if entry[0].nbytes == nbytes:
                del self._free[i]
                break
        else:
            region = SharedBuffer(nbytes) if self.shared else None
            entry = (region.array() if region is not None else np.empty(nbytes, dtype=np.uint8), region)
        self._out.append(entry)
        return entry[0], entry[1].where if entry[1] is not None else None


def begin_snapshot(state: Mapping[str, Any], version: int, bucket_bytes: int, pool: BufferPool) -> Snapshot:
    """An empty snapshot laid out for ``state`` (every dtype checked), with a fresh key; fill it
    with :func:`fill`."""
    entries, total = layout(state)
    devices = {str(t.device) if is_torch(t) else "cpu" for t in state.values()}
    flat: np.ndarray | torch.Tensor
    shared: list[Any] | None
    if len(devices) == 1 and next(iter(devices)).startswith("cuda"):
        import torch

        device = next(iter(devices))
        flat, shared = torch.empty(total, dtype=torch.uint8, device=device), None
    else:
        (flat, shared), device = pool.get(total), "cpu"
    bucket = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
    snap = Snapshot(Manifest(version, entries, total, bucket, [], KEYED), flat, device, sealed=False)
    snap.shared = shared
    return snap


def sources(snap: Snapshot, state: Mapping[str, Any]) -> list[Any]:
    """Every entry of ``state`` as a flat byte view ready to copy into ``snap``. All that can
    fail on a bad value (a meta tensor, an object that is no tensor) fails here, before the
    snapshot is announced to the fan-out."""
    on_device = not isinstance(snap.flat, np.ndarray)
    out = []
    for t in state.values():
        if on_device:
            out.append(t.detach().contiguous().reshape(-1).view(snap.flat.dtype))
        elif is_torch(t):
            out.append(_np(t.cpu()).reshape(-1).view(np.uint8))  # reshape copies only a non-contiguous tensor
        else:  # a host array from state_dict_of (bfloat16: ml_dtypes' type, viewed as its bytes)
            out.append(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
    return out


def fill(snap: Snapshot, srcs: list[Any]) -> None:
    """Copy the views from :func:`sources` into ``snap`` in bucket-sized pieces, releasing each
    bucket to the fan-out as soon as it is copied; then tag every bucket (while the first ones
    are on their way) and seal the snapshot. A snapshot in shared memory is tagged from a
    private copy instead (:func:`_fill_tagged`)."""
    if snap.shared is not None:
        _fill_tagged(snap, srcs)
        return
    buckets = snap.manifest.buckets()
    on_device = not isinstance(snap.flat, np.ndarray)
    released = 0

    def release_upto(done: int) -> None:
        nonlocal released
        n = released
        while n < len(buckets) and buckets[n][1] <= done:
            n += 1
        if n > released:
            if on_device and snap.flat.device.type == "cuda":
                import torch

                # Other threads read the buckets (the host copy, the tags): the copy must be done.
                torch.cuda.current_stream(snap.flat.device).synchronize()
            with snap._cv:
                snap.ready = released = n
                snap._cv.notify_all()

    for e, src in zip(snap.manifest.entries, srcs):
        at = 0
        while at < len(src):
            stop = min(len(src), (e.offset + at) // snap.manifest.bucket_bytes * snap.manifest.bucket_bytes
                       + snap.manifest.bucket_bytes - e.offset)  # fmt: skip
            snap.flat[e.offset + at : e.offset + stop] = src[at:stop]
            at = stop
            release_upto(e.offset + at)
    release_upto(snap.manifest.total_bytes)
    if on_device:  # tagged from the host copy the weights streams send (_tag_on_host)
        _tag_on_host(snap)
        return
    tags = snap.key.tags(snap.flat, buckets, snap.version)
    with snap._cv:
        snap.tags = tags
        snap.sealed = True
        snap._cv.notify_all()


def _tag_on_host(snap: Snapshot) -> None:
    """Seal a device snapshot with tags computed on one host copy of its bytes, kept as
    ``snap.host``: every actor receives a version in host memory (the weights streams
    send that copy), and OpenSSL's GMAC runs on the CPU."""
    flat = host_bytes(snap.flat, 0, snap.manifest.total_bytes)
    tags = snap.key.tags(flat, snap.manifest.buckets(), snap.version)
    host = Snapshot(snap.manifest, flat, "cpu", key=snap.key, tags=tags)
    with snap._cv:
        snap.host, snap.tags = host, tags
        snap.sealed = True
        snap._cv.notify_all()


def _fill_tagged(snap: Snapshot, srcs: list[Any]) -> None:
    """Fill a snapshot whose buffer other processes of this user can open (a memfd, shared.py):
    each piece of a bucket is put together in private memory (small enough to stay in cache),
    added to the bucket's tag there, then copied into the buffer; a bucket is released once all its
    pieces are in. Bytes written into the buffer meanwhile fail their tags; a tag taken from
    the buffer itself would have vouched for them."""
    buckets = snap.manifest.buckets()
    entries = list(zip(snap.manifest.entries, srcs))
    scratch = _scratch()
    tags: list[bytes] = []
    first = 0  # the first entry that may still overlap the piece
    for i, (a, b) in enumerate(buckets):
        tagger = snap.key.tagger(a, b, snap.version, i)
        for c in range(a, b, _PIECE):
            d = min(b, c + _PIECE)
            piece = scratch[: d - c]
            piece[:] = 0  # the alignment padding between tensors
            for e, src in entries[first:]:
                if e.offset >= d:
                    break
                lo, hi = max(c, e.offset), min(d, e.offset + len(src))
                if lo < hi:
                    piece[lo - c : hi - c] = src[lo - e.offset : hi - e.offset]
                if e.offset + len(src) <= d:
                    first += 1
            tagger.update(piece)
            snap.flat[c:d] = piece
        tags.append(tagger.finalize())
        with snap._cv:
            snap.ready = i + 1
            snap._cv.notify_all()
    with snap._cv:
        snap.tags = tags
        snap.sealed = True
        snap._cv.notify_all()


_PIECE = 4 << 20  # staged and tagged in private memory at a time: stays in L2/L3
_scratches = threading.local()


def _scratch() -> np.ndarray:
    """This thread's private staging buffer (one publish at a time per thread)."""
    buf = getattr(_scratches, "buf", None)
    if buf is None:
        buf = _scratches.buf = np.empty(_PIECE, dtype=np.uint8)
    return buf


def snapshot(state: Mapping[str, Any], version: int, bucket_bytes: int, pool: BufferPool) -> Snapshot:
    """Copy ``state`` into a flat buffer (so training may go on at once) and tag it."""
    snap = begin_snapshot(state, version, bucket_bytes, pool)
    fill(snap, sources(snap, state))
    return snap

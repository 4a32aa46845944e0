"""Batch assembly: turn claimed ring pieces into batch tensors on the dataset's device.

On CPU, a batch that is exactly one ring chunk is lent without a copy (see ``StepRing``);
otherwise pieces are copied into staging buffers from a small pool, reused only once nothing
outside the pool refers to them (so a batch the user kept is never overwritten). On CUDA the
ring is pinned and pieces are copied with ``non_blocking=True`` on a side stream; the user's
stream waits for that copy, and a small thread releases the ring space as soon as the copy has
completed (not at the next fetch: space held until then would hold back the actors' credits
for a whole training step, and a flushing actor for as long as the learner does not fetch).
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from typing import Any

import numpy as np

from ..batch import Batch, Host
from ..wire.codec import torch_dtype, typed_view
from ..wire.frameworks import Adapter, aligned, typed
from ..wire.frameworks import adapter as make_adapter
from .ring import Piece, StepRing

_POOL_SIZE = 4
_LOOP_PIECES = 8  # up to this many pieces a loop over them beats the vectorized metadata


class _Staging:
    """Host arrays for one batch, 64-byte aligned (XLA takes only aligned memory without a copy);
    arrays handed out from them (torch tensors, DLPack views) keep them referenced."""

    def __init__(self, ring: StepRing, batch_size: int):
        self.arrays = [aligned((batch_size * spec.step_bytes,)) for spec in ring.schema.fields]

    def in_use(self) -> bool:
        # Each torch tensor (and every view of one) keeps its numpy base alive through its
        # storage, as does a DLPack capsule JAX or TensorFlow holds;
        # 3 = the list slot + the loop variable + getrefcount's own argument.
        return any(sys.getrefcount(arr) > 3 for arr in self.arrays)


class BatchAssembler:
    """Builds each batch in host memory and hands it out through ``adapter`` (a framework and
    a device, ``wire/frameworks.py``); torch on CUDA has its own pinned, asynchronous path."""

    def __init__(self, ring: StepRing, batch_size: int, adapter: Adapter | Any):
        # a bare device (what the assembler took before it took formats): torch on that device
        self.adapter = adapter if isinstance(adapter, Adapter) else make_adapter("torch", adapter)
        adapter = self.adapter
        self.ring = ring
        self.batch_size = batch_size
        self.device = adapter.device
        self.cuda = adapter.cuda
        self.lends = ring.chunk_steps == batch_size and not self.cuda
        self.lent_batches = 0
        self._pool: list[_Staging] = []
        self.torch: Any = None
        self._stream: Any = None
        self._dtypes: list[Any] = []
        if self.cuda:
            import torch

            self.torch = torch
            # torch.cuda.Stream.__new__ is unannotated in torch's sources
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._dtypes = [torch_dtype(f.dtype) for f in ring.schema.fields]
        # (CUDA event, take id) of device copies in flight; None stops the releasing thread
        self._copies: queue.SimpleQueue[tuple[Any, int] | None] = queue.SimpleQueue()
        self._releaser: threading.Thread | None = None
        if self.cuda:
            self._releaser = threading.Thread(target=_release_when_copied, args=(self._copies, ring), daemon=True,
                                              name="rlink-release")  # fmt: skip
            self._releaser.start()
            weakref.finalize(self, self._copies.put, None)

    def close(self, timeout: float) -> None:
        """Stop the thread that releases ring space after device copies, once the copies in
        flight completed (at most ``timeout`` seconds). Idempotent."""
        if self._releaser is not None and self._releaser.is_alive():
            self._copies.put(None)
            self._releaser.join(timeout)

    def assemble(self, pieces: list[Piece], take_id: int, learner_version: int) -> Batch:
        """The batch of ``pieces`` (``batch_size`` steps, or fewer for the last one of a stream)."""
        meta = self._meta(pieces, learner_version)
        n = sum(p.count for p in pieces)
        batch = self._assemble_cuda(pieces, take_id, meta) if self.cuda else self._assemble_cpu(pieces, take_id, meta, n)
        return batch if n == self.batch_size else batch.head(n)

    def _meta(self, pieces: list[Piece], learner_version: int) -> np.ndarray:
        """Per step: version, actor_id, seq, staleness. Beyond a few pieces in a few numpy calls
        whatever their number: a batch of small frames from several actors has hundreds, and a
        Python loop over them is the fetching thread's largest cost (docs/benchmarks.md)."""
        meta = np.empty((4, self.batch_size), dtype=np.int64)
        if len(pieces) <= _LOOP_PIECES:
            i = 0
            for p in pieces:
                meta[0, i : i + p.count] = p.version
                meta[1, i : i + p.count] = p.actor_id
                meta[2, i : i + p.count] = np.arange(p.seq, p.seq + p.count)
                i += p.count
        else:
            # (seq is a u64 on the wire, counted from 0: int64 holds it for 2**63 steps)
            flat: list[int] = []  # one flat list: numpy takes it several times faster than tuples
            for p in pieces:
                flat += (p.count, p.version, p.actor_id, p.seq)
            per_piece = np.array(flat, dtype=np.int64).reshape(-1, 4)
            counts = per_piece[:, 0]
            n = int(counts.sum())
            meta[0, :n] = np.repeat(per_piece[:, 1], counts)
            meta[1, :n] = np.repeat(per_piece[:, 2], counts)
            # the seq of batch row i in a piece whose first row is r: the piece's seq + (i - r)
            first_rows = np.cumsum(counts) - counts
            np.add(np.arange(n), np.repeat(per_piece[:, 3] - first_rows, counts), out=meta[2, :n])
        np.subtract(learner_version, meta[0], out=meta[3])
        return meta

    def _staging(self) -> _Staging:
        for staging in self._pool:
            if not staging.in_use():
                return staging
        staging = _Staging(self.ring, self.batch_size)
        if len(self._pool) < _POOL_SIZE:
            self._pool.append(staging)
        return staging

    def _batch(self, arrays: list[np.ndarray], meta_host: np.ndarray) -> Batch:
        # Each array is handed out through the adapter on first access (Batch, Host).
        fields = {spec.name: Host(typed(host, spec.dtype, (self.batch_size, *spec.shape)), spec.dtype)
                  for spec, host in zip(self.ring.schema.fields, arrays)}  # fmt: skip
        meta = [Host(row, "int64") for row in meta_host]
        return Batch(fields, version=meta[0], actor_id=meta[1], seq=meta[2], staleness=meta[3],
                     convert=self.adapter.array)  # fmt: skip

    def _assemble_cpu(self, pieces: list[Piece], take_id: int, meta: np.ndarray, n: int) -> Batch:
        try:
            lent = self.ring.lend_chunk(pieces) if self.lends and n == self.batch_size else None
            if lent is not None:
                self.lent_batches += 1
                return self._batch(lent, meta)
            staging = self._staging()
            spans = joined(pieces, self.ring.chunk_steps)
            for f, (spec, host) in enumerate(zip(self.ring.schema.fields, staging.arrays)):
                # numpy, not torch: torch's intra-op threads make CPU copies ~10x slower
                # when the other cores are busy receiving (measured in docs/benchmarks.md).
                sb = spec.step_bytes
                i = 0
                for p in spans:
                    host[i * sb : (i + p.count) * sb] = self.ring.piece_bytes(f, p)
                    i += p.count
            return self._batch(staging.arrays, meta)
        finally:
            self.ring.release(take_id)

    def _assemble_cuda(self, pieces: list[Piece], take_id: int, meta_host: np.ndarray) -> Batch:
        torch = self.torch
        fields = {}
        spans = joined(pieces, self.ring.chunk_steps)
        with torch.cuda.stream(self._stream):
            for f, (spec, dtype) in enumerate(zip(self.ring.schema.fields, self._dtypes)):
                out = torch.empty((self.batch_size, *spec.shape), dtype=dtype, device=self.device)
                i = 0
                for p in spans:
                    src = typed_view(torch.from_numpy(self.ring.piece_bytes(f, p)), dtype, p.count, *spec.shape)
                    out[i : i + p.count].copy_(src, non_blocking=True)
                    i += p.count
                fields[spec.name] = out
            meta = torch.from_numpy(meta_host).pin_memory().to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._copies.put((event, take_id))
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        for tensor in (*fields.values(), meta):
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return Batch(fields, version=meta[0], actor_id=meta[1], seq=meta[2], staleness=meta[3])


def joined(pieces: list[Piece], chunk_steps: int) -> list[Piece]:
    """``pieces`` with each run of adjacent ones in one ring chunk as a single piece (only its
    position and count mean anything). Frames of several actors land side by side in the ring,
    so a batch of hundreds of small frames is copied in a few slices per field, not hundreds."""
    out: list[Piece] = []
    if not pieces:
        return out
    first = pieces[0]
    start, end = first.start, first.start + first.count
    for p in pieces[1:]:
        if p.start == end and p.start % chunk_steps:  # goes on from the run, in the same chunk
            end += p.count
            continue
        out.append(first if end - start == first.count else Piece(start, end - start, first.actor_id, first.seq,
                                                                  first.version))  # fmt: skip
        first, start, end = p, p.start, p.start + p.count
    out.append(first if end - start == first.count else Piece(start, end - start, first.actor_id, first.seq,
                                                              first.version))  # fmt: skip
    return out


def _release_when_copied(copies: queue.SimpleQueue[tuple[Any, int] | None], ring: StepRing) -> None:
    """Release each take's ring space once its device copy completed, in order. It holds the
    ring, not the assembler, so a dropped dataset stops it (``None`` from its finalizer)."""
    while (item := copies.get()) is not None:
        event, take_id = item
        event.synchronize()  # releases the GIL while it waits
        ring.release(take_id)

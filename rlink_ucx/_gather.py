"""Batch assembly: copy claimed ring pieces into batch tensors on the dataset's device.

On CPU the batch tensors come from a small pool of staging buffers, reused only once nothing
outside the pool refers to them any more (so a batch the user kept is never overwritten). On
CUDA the ring is pinned and pieces are copied with ``non_blocking=True`` on a side stream;
the user's stream waits for that copy, and the ring space is released once it completed.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._batch import Batch
from ._store import Piece, StepRing
from ._torch_dtypes import torch_dtype

_POOL_SIZE = 4


class _Staging:
    """Host arrays for one batch; torch tensors made from them keep them referenced."""

    def __init__(self, ring: StepRing, batch_size: int):
        self.arrays = []
        for spec in ring.schema.fields:
            host = np.empty(batch_size * spec.step_bytes, dtype=np.uint8)
            self.arrays.append(host)
        self.meta = np.empty((4, batch_size), dtype=np.int64)  # version, actor_id, seq, staleness

    def in_use(self) -> bool:
        # Each torch tensor (and every view of one) keeps its numpy base alive through its
        # storage; 3 = the list slot + the loop variable + getrefcount's own argument.
        for arr in self.arrays:
            if sys.getrefcount(arr) > 3:
                return True
        return sys.getrefcount(self.meta) > 3


class BatchAssembler:
    def __init__(self, ring: StepRing, batch_size: int, device: Any):
        import torch

        self.torch = torch
        self.ring = ring
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._pool: list[_Staging] = []
        self._pending: list[tuple[Any, int]] = []  # (CUDA event, take id) of copies in flight
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._dtypes = [torch_dtype(f.dtype) for f in ring.schema.fields]

    def release_finished(self, wait: bool = False) -> None:
        """Free ring space whose device copies completed (all of it when ``wait``)."""
        while self._pending and (wait or self._pending[0][0].query()):
            event, take_id = self._pending.pop(0)
            event.synchronize()
            self.ring.release(take_id)

    def assemble(self, pieces: list[Piece], take_id: int, learner_version: int) -> Batch:
        if self.cuda:
            return self._assemble_cuda(pieces, take_id, learner_version)
        return self._assemble_cpu(pieces, take_id, learner_version)

    def _meta_into(self, meta: np.ndarray, pieces: list[Piece], learner_version: int) -> None:
        i = 0
        for p in pieces:
            meta[0, i : i + p.count] = p.version
            meta[1, i : i + p.count] = p.actor_id
            meta[2, i : i + p.count] = np.arange(p.seq, p.seq + p.count)
            i += p.count
        np.subtract(learner_version, meta[0], out=meta[3])

    def _staging(self) -> _Staging:
        for staging in self._pool:
            if not staging.in_use():
                return staging
        staging = _Staging(self.ring, self.batch_size)
        if len(self._pool) < _POOL_SIZE:
            self._pool.append(staging)
        return staging

    def _assemble_cpu(self, pieces: list[Piece], take_id: int, learner_version: int) -> Batch:
        torch = self.torch
        staging = self._staging()
        fields = {}
        try:
            for spec, host, dtype, ring_bytes in zip(self.ring.schema.fields, staging.arrays, self._dtypes,
                                                     self.ring.host_bytes):  # fmt: skip
                # numpy, not torch: torch's intra-op threads make CPU copies ~10x slower
                # when the other cores are busy receiving (measured in docs/benchmarks.md).
                sb = spec.step_bytes
                i = 0
                for p in pieces:
                    host[i * sb : (i + p.count) * sb] = ring_bytes[p.start * sb : (p.start + p.count) * sb]
                    i += p.count
                fields[spec.name] = torch.from_numpy(host).view(dtype).view(self.batch_size, *spec.shape)
        finally:
            self.ring.release(take_id)
        self._meta_into(staging.meta, pieces, learner_version)
        meta = torch.from_numpy(staging.meta)
        return Batch(fields, version=meta[0], actor_id=meta[1], seq=meta[2], staleness=meta[3])

    @staticmethod
    def _copy_pieces(out: Any, ring_view: Any, pieces: list[Piece]) -> None:
        i = 0
        for p in pieces:
            out[i : i + p.count].copy_(ring_view[p.start : p.start + p.count], non_blocking=True)
            i += p.count

    def _assemble_cuda(self, pieces: list[Piece], take_id: int, learner_version: int) -> Batch:
        torch = self.torch
        self.release_finished()
        meta_host = np.empty((4, self.batch_size), dtype=np.int64)
        self._meta_into(meta_host, pieces, learner_version)
        fields = {}
        with torch.cuda.stream(self._stream):
            for spec, dtype, ring_view in zip(self.ring.schema.fields, self._dtypes, self.ring.views):
                out = torch.empty((self.batch_size, *spec.shape), dtype=dtype, device=self.device)
                self._copy_pieces(out, ring_view, pieces)
                fields[spec.name] = out
            meta = torch.from_numpy(meta_host).pin_memory().to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending.append((event, take_id))
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        for tensor in (*fields.values(), meta):
            tensor.record_stream(torch.cuda.current_stream(self.device))
        return Batch(fields, version=meta[0], actor_id=meta[1], seq=meta[2], staleness=meta[3])

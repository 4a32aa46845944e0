"""A replay table whose field storage lives on a torch device: sampling is a device gather.

Same ids, slots, metadata and sequence links as :class:`ReplayTable` (those stay in host
memory: the samplers read them), but each field is a ``[capacity, step_bytes]`` uint8 tensor
on ``device``. A sample is one ``torch.index_select`` per field on the device, with no host
round trip of the step bytes; an insert is one host-to-device copy per field and ring piece.

On CUDA the inserts copy on a stream of their own and wait for it before the ring space is
released. A gather still queued on a user's stream may read slots that an insert has just
evicted, so each gather records an event and an insert's copies wait for the events recorded
before its eviction. Checkpoints stream the rows through two pinned host buffers, so the
copy of one chunk overlaps the hashing and writing (or reading) of the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np

from ...errors import ConfigError
from ...wire.codec import Schema
from .storage import host_storage, populate_all, populated
from .table import ReplayTable

__all__ = ["DeviceTable"]


class DeviceTable(ReplayTable):
    on_device = True

    def __init__(self, schema: Schema, capacity: int, sequence_length: int | None = None, *, device: Any,
                 touch: bool = True):  # fmt: skip
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # inserts and checkpoint copies; torch.cuda.Stream.__new__ is unannotated in torch's sources
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._reads: dict[int, Any] = {}  # CUDA stream id -> event after that stream's last gather
        self._before_evict: list[Any] = []  # those events, as they were at the last eviction
        super().__init__(schema, capacity, sequence_length, touch=touch)

    def _make_rows(self, pin: bool, touch: bool) -> list[Any]:
        torch = self.torch
        nbytes = sum(self.capacity * f.step_bytes for f in self.schema.fields)
        try:
            if self.cuda:
                return [torch.empty((self.capacity, f.step_bytes), dtype=torch.uint8, device=self.device)
                        for f in self.schema.fields]  # fmt: skip
            # On CPU: tensors over host storage with guard space, which a load reads into directly;
            # populated now unless a load is about to fill them (its reads overlap the faults).
            rows = [host_storage(self.capacity * f.step_bytes, huge=touch) for f in self.schema.fields]
            if touch:
                for flat in rows:
                    populate_all(flat)
            return [torch.from_numpy(flat).view(self.capacity, -1) for flat in rows]
        except (RuntimeError, MemoryError, OSError) as exc:  # out of memory on the device
            raise ConfigError(f"a replay table of {nbytes / 1e9:.2f} GB does not fit on {self.device}: {exc}") from exc

    # --- inserting ----------------------------------------------------------------------------------
    def evict_for(self, n: int) -> range:
        self._before_evict = list(self._reads.values())  # under the replay's lock, like the gathers
        return super().evict_for(n)

    def write(self, start_id: int, fields: list[np.ndarray], count: int) -> None:
        torch = self.torch
        if self.cuda:
            for event in self._before_evict:  # gathers still queued may read the evicted slots
                self.stream.wait_event(event)
            self._before_evict = []
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            for rows, data in zip(self.rows, fields):
                sb = rows.shape[1]
                src = torch.from_numpy(data)
                for slot, lo, k in self._runs(start_id, count):
                    rows[slot : slot + k].view(-1).copy_(src[lo * sb : (lo + k) * sb], non_blocking=self.cuda)

    def finish_writes(self) -> None:
        if self.cuda:
            self.stream.synchronize()  # the ring's bytes are released (and reused) after this

    # --- sampling -----------------------------------------------------------------------------------
    def gather_device(self, ids: np.ndarray, outs: list[np.ndarray] | None, slots: np.ndarray | None) -> list[Any]:
        """Per field, the ``[ids.size, step_bytes]`` uint8 rows of ``ids`` on the device: into
        ``outs`` (host staging, on CPU) or new tensors (CUDA), the slot numbers staged in the
        pinned ``slots`` for their copy to the device."""
        torch = self.torch
        flat = (np.asarray(ids, dtype=np.int64) % self.capacity).ravel()
        if not self.cuda:
            index = torch.from_numpy(flat)
            assert outs is not None
            return [torch.index_select(rows, 0, index, out=torch.from_numpy(out)) for rows, out in zip(self.rows, outs)]
        assert slots is not None
        slots[:] = flat
        index = torch.from_numpy(slots).to(self.device, non_blocking=True)
        got = [torch.index_select(rows, 0, index) for rows in self.rows]
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        self._reads[stream.stream_id] = event
        return got

    # --- checkpoints --------------------------------------------------------------------------------
    def chunks(self, field: int, runs: list[tuple[int, int]], size: int) -> Iterator[np.ndarray]:
        if not self.cuda:
            yield from self._host_views(field, runs, size)
            return
        torch = self.torch
        pieces = self._pieces(field, runs, size)
        bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(min(2, len(pieces)))]

        def fetch(i: int) -> Any:
            with torch.cuda.stream(self.stream):
                bufs[i % 2][: pieces[i].numel()].copy_(pieces[i], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            return event

        ready: Any = fetch(0) if pieces else None
        for i, piece in enumerate(pieces):
            ready.synchronize()
            ready = fetch(i + 1) if i + 1 < len(pieces) else None  # the next copy runs while this one is used
            yield bufs[i % 2][: piece.numel()].numpy()

    def sinks(self, field: int, runs: list[tuple[int, int]], size: int) -> Iterator[np.ndarray]:
        if not self.cuda:
            yield from populated(list(self._host_views(field, runs, size)))
            return
        torch = self.torch
        pieces = self._pieces(field, runs, size)
        # With guard space around them: the load reads into them with O_DIRECT (direct_read.py).
        bufs = [torch.from_numpy(host_storage(size, pin=True)) for _ in range(min(2, len(pieces)))]
        copied: list[Any] = [None, None]
        for i, piece in enumerate(pieces):
            buf = bufs[i % 2]
            if copied[i % 2] is not None:
                copied[i % 2].synchronize()  # this buffer's previous copy to the device is done
            yield buf[: piece.numel()].numpy()
            with torch.cuda.stream(self.stream):
                piece.copy_(buf[: piece.numel()], non_blocking=True)
                copied[i % 2] = torch.cuda.Event()
                copied[i % 2].record(self.stream)
        self.stream.synchronize()

    def _pieces(self, field: int, runs: list[tuple[int, int]], size: int) -> list[Any]:
        out = []
        for s, k in runs:
            flat = self.rows[field][s : s + k].view(-1)
            out += [flat[lo : lo + size] for lo in range(0, flat.numel(), size)]
        return out

    def _host_views(self, field: int, runs: list[tuple[int, int]], size: int) -> Iterator[np.ndarray]:
        for piece in self._pieces(field, runs, size):  # CPU tensors: numpy views of the storage itself
            yield piece.numpy()

"""The replay's state behind one lock: table, sampler and rate limiter; inserts and samples.

Inserts happen in three moves so that a sample never waits for a whole copy: under the lock
the oldest steps are evicted to make room (so no sampler can pick them), the step bytes are
copied into the freed slots without the lock, and under the lock again the new ids become
visible. A ``BlockTable`` (large steps, host memory) copies only what it cannot take whole:
in the first move it maps whole ring chunks that are its own blocks to their steps and picks
free blocks to put in the ring in their place, swapped in during the second.

A sample picks ids and finds their rows under the lock, then copies the rows without it, into
staging buffers reused only once no batch refers to them; so several threads may gather at
once (``store/replay/sample_ahead.py``). An insert that must evict waits until no gather is copying
(an evicted row may be overwritten at once), and while it waits no new gather starts.
With ``storage="device"`` the rows live on the device (``DeviceTable``) and a sample gathers
them there; only the ids, weights and metadata go through host staging.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...batch import Batch, Host
from ...errors import Closed, ConfigError, SchemaMismatch
from ...errors import TimeoutError as RLinkTimeout
from ...wire.codec import Schema, torch_dtype, typed_view
from ...wire.frameworks import Adapter, typed
from ..ring import Piece, StepRing
from .block_table import BlockTable, spare_blocks
from .device_table import DeviceTable
from .gate import InsertGate
from .limiter import RateLimiter
from .pieces import ChunkGroup, chunk_groups, contiguous, streams
from .samplers import UniformSampler, _checked, make_sampler
from .split_gather import gather_rows
from .staging import Draw, Staging, StagingPool
from .table import PRIORITY_FIELD, ReplayTable

__all__ = ["ReplayCore", "ReplaySettings", "stored_schema"]

ADOPT_MIN_BYTES = 1 << 20  # ring chunks at least this large are taken without copying (host tables)


def stored_schema(stream: Schema) -> Schema:
    """The fields a replay keeps of an actor stream: all but the reserved priority field."""
    return Schema(tuple(f for f in stream.fields if f.name != PRIORITY_FIELD))


@dataclass(frozen=True)
class ReplaySettings:
    """What a replay core is made with, fixed for its life."""

    capacity: int
    batch_size: int
    sampler: str  # the sampler's kind (samplers.make_sampler)
    sequence_length: int | None
    alpha: float
    beta: float
    storage: str  # "host": numpy rows (pinned where CUDA exists); "device": tensors on device
    device: Any  # the batches' device (wire/frameworks.py)
    cuda: bool
    pin: bool  # host staging (and host rows) in page-locked memory


class ReplayCore:
    """The replay's table, sampler and rate limiter behind one lock (``gate.cond``): inserts
    from the inserter thread, samples from any thread."""

    def __init__(self, *, capacity: int, batch_size: int, sampler: str, sequence_length: int | None,
                 alpha: float, beta: float, limiter: RateLimiter, adapter: Adapter,
                 version: Callable[[], int], seed: int | None = None, storage: str = "host"):  # fmt: skip
        self.adapter = adapter  # the batches' framework and device (wire/frameworks.py)
        self.torch: Any = None
        if adapter.format == "torch":
            import torch

            self.torch = torch
        pin = adapter.cuda or (self.torch is not None and self.torch.cuda.is_available())
        self.settings = ReplaySettings(capacity=capacity, batch_size=batch_size, sampler=sampler,
                                       sequence_length=sequence_length, alpha=alpha, beta=beta, storage=storage,
                                       device=adapter.device, cuda=adapter.cuda, pin=pin)  # fmt: skip
        self.limiter = limiter
        self.version = version
        self.rng = np.random.default_rng(seed)
        self.gate = InsertGate()
        self.cond = self.gate.cond  # guards everything below, and the table, sampler and limiter
        self.table: ReplayTable | None = None
        self.sampler: UniformSampler | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.ended = False  # the inserter stopped: nothing more will arrive
        self._stream: tuple[list[int], int | None] | None = None  # ring field per stored field, priority field
        self.adopt_min_bytes = ADOPT_MIN_BYTES
        self.ring_geometry: tuple[int, int] | None = None  # the learner ring's (chunk_steps, capacity), once known
        self.pool = StagingPool()
        self._dtypes: list[Any] = []

    # --- setup ------------------------------------------------------------------------------------
    def build(self, schema: Schema, touch: bool = True, ring: tuple[int, int] | None = None) -> None:
        """Allocate the table for ``schema`` (the stored fields); lock held or not yet shared.
        ``ring``: the learner ring's ``(chunk_steps, capacity)`` if known, for ``adopts``."""
        ring, s = ring or self.ring_geometry, self.settings
        if s.storage == "device":
            self.table = DeviceTable(schema, s.capacity, s.sequence_length, device=s.device, touch=touch)
        elif ring is not None and self._adoptable(schema, *ring):
            chunk, steps = ring
            self.table = BlockTable(schema, s.capacity, s.sequence_length, block=chunk,
                                    spare=spare_blocks(steps, chunk), touch=touch)  # fmt: skip
        else:
            self.table = ReplayTable(schema, s.capacity, s.sequence_length, pin=s.pin, touch=touch)
        self.sampler = make_sampler(s.sampler, self.table, self.rng, s.alpha, s.beta)
        self._dtypes = [torch_dtype(f.dtype) for f in schema.fields] if self.torch is not None else []

    def _adoptable(self, schema: Schema, chunk: int, ring_steps: int) -> bool:
        """Whether a host table takes whole ring chunks without copying (``BlockTable``): large
        steps (copying them is what costs), unpinned storage (the ring keeps some of its blocks
        after the replay is gone), and a ring small next to the table (its blocks are extra)."""
        return (not self.settings.pin and chunk * schema.step_bytes >= self.adopt_min_bytes
                and 4 * ring_steps <= self.settings.capacity)  # fmt: skip

    @property
    def adopts(self) -> bool:
        """Inserts take whole ring chunks into the table without copying them."""
        return isinstance(self.table, BlockTable)

    def attach(self, stream: Schema, ring: tuple[int, int] | None = None) -> None:
        """The learner's stream schema is known: allocate, or check it against a loaded table.
        ``ring``: its ring's ``(chunk_steps, capacity)``."""
        stored = stored_schema(stream)
        names = [f.name for f in stream.fields]
        with self.cond:
            if self.table is None:
                self.build(stored, ring=ring)
            elif self.table.schema != stored:
                raise SchemaMismatch(f"the actors' schema {stored.describe()} does not match the replay's "
                                     f"{self.table.schema.describe()}: {self.table.schema.compare(stored)}")  # fmt: skip
            prio = names.index(PRIORITY_FIELD) if PRIORITY_FIELD in names else None
            if prio is not None and stream.fields[prio].describe() != "float32[]":
                raise SchemaMismatch(f"field {PRIORITY_FIELD!r} is reserved for priorities (float32, one per step)")
            self._stream = ([names.index(f.name) for f in stored.fields], prio)
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The inserter died: every later sample raises ``exc``."""
        with self.cond:
            self.error = exc
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def close_inserts(self) -> None:
        """No step will come any more (the learner closed): a sample that must wait fails."""
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    # --- inserting (the inserter thread) ----------------------------------------------------------
    def wait_room(self) -> int | None:
        """Block until a step may be inserted; returns how many (None: any number; 0: closing)."""
        with self.cond:
            while not self.closed:
                room = self._room()
                if room is None or room > 0:
                    return room
                self.cond.wait()
            return 0

    def _room(self) -> int | None:
        if self.gate.paused or self.table is None or self.sampler is None:
            return 0
        rooms = [r for r in (self.limiter.insert_room(self.table.held), self.sampler.insert_room()) if r is not None]
        return min(rooms) if rooms else None

    def insert(self, ring: StepRing, pieces: list[Piece]) -> None:
        """Put the taken ``pieces`` into the table (the caller releases the ring space)."""
        n = sum(p.count for p in pieces)
        if not n:
            return
        table, sampler = self.table, self.sampler
        assert table is not None and sampler is not None and self._stream is not None
        fields, prio = self._stream
        groups = chunk_groups(ring, pieces, fields, table) if isinstance(table, BlockTable) else None
        with self.cond:
            # Rows about to be evicted may be being copied into a batch: wait for those copies.
            self.gate.wait_to_insert(table.held + n > table.capacity)
            sampler.on_evict(table.evict_for(n))
            start = table.inserted
            swap = self._plan_swap(table, start, groups) if groups is not None else None
            self.gate.begin_insert()
        priorities = None
        try:
            # Read the priorities first: a chunk handed back to the ring below is no longer readable.
            if prio is not None:
                priorities = np.concatenate([ring.piece_bytes(prio, p).view(np.float32) for p in pieces])
            if swap is None:
                at = start
                for span in contiguous(pieces, ring.chunk_steps):  # one copy per run of consecutive ring positions
                    table.write(at, [ring.piece_bytes(i, span) for i in fields], span.count)
                    at += span.count
            else:
                self._swap_in(ring, swap)
            at = start
            for run in streams(pieces):  # one description per run of one actor's consecutive steps
                table.describe(at, run.count, run.actor_id, run.seq, run.version)
                at += run.count
        finally:
            table.finish_writes()
            with self.cond:
                self.gate.end_insert()
                table.publish(n)
                ids = np.arange(start, start + n, dtype=np.int64)
                sampler.on_insert(ids, priorities)
                self.limiter.inserted += n
                self.cond.notify_all()

    def _plan_swap(self, table: ReplayTable, start: int, groups: list[ChunkGroup]) -> _Swap:
        """Where the groups' steps go from ``start`` on (lock held): a whole chunk gets a free
        block of the table in its place in the ring; one that is a block of ours becomes its
        steps' rows only then (never left in the ring)."""
        assert isinstance(table, BlockTable)  # chunk groups are made for block tables only
        lends = [table.lend_block() if g.whole else None for g in groups]
        plan = table.place(start, [(g.count, g.adopt if lend is not None else None)
                                   for g, lend in zip(groups, lends)])  # fmt: skip
        return _Swap(table, groups, plan, lends)

    def _swap_in(self, ring: StepRing, swap: _Swap) -> None:
        """Copy the steps a block table cannot take whole and swap the whole chunks (no lock)."""
        assert self._stream is not None
        fields, table = self._stream[0], swap.table
        for group, runs, lend in zip(swap.groups, swap.plan, swap.lends):
            if runs:
                spans = list(contiguous(group.pieces, ring.chunk_steps))
                table.copy_in(runs, [[ring.piece_bytes(i, s) for s in spans] for i in fields])
            if lend is not None and ring.lend_chunk(group.pieces, self._ring_chunk(table, lend, ring)) is None:
                raise RuntimeError("a whole ring chunk could not be swapped")  # chunk_groups checked it

    def _ring_chunk(self, table: BlockTable, block: int, ring: StepRing) -> list[np.ndarray]:
        """The free ``block`` as a ring chunk: its rows per stored field, in the stream's field
        order, and a small buffer of its own for the priority field (not stored as a field)."""
        assert self._stream is not None
        fields, prio = self._stream
        views = table.block_views(block)
        chunk: list[np.ndarray] = [np.empty(0, dtype=np.uint8)] * len(ring.schema.fields)
        for i, view in zip(fields, views):
            chunk[i] = view
        if prio is not None:
            chunk[prio] = np.empty(ring.chunk_steps * ring.schema.fields[prio].step_bytes, dtype=np.uint8)
        return chunk

    # --- sampling ---------------------------------------------------------------------------------
    def sample(self, timeout: float, split: bool = True) -> Batch:
        """One batch. ``split``: a large host gather may be shared with the split-gather helper
        (threads sampling ahead pass False: they gather side by side instead)."""
        deadline, batch_size = time.monotonic() + timeout, self.settings.batch_size
        with self.cond:
            while True:
                if self.error is not None:
                    raise _again(self.error)
                if self.closed:
                    raise Closed("the replay is closed")
                table, sampler = self.table, self.sampler
                got = None
                if (table is not None and sampler is not None and self.gate.may_sample()
                        and self.limiter.can_sample(batch_size, table.held)):  # fmt: skip
                    got = sampler.sample(batch_size)
                if got is not None:
                    break
                if self.ended:
                    raise Closed("the learner is closed: no more steps will arrive, " + self._why_waiting(None))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.timed_out(timeout)
                self.cond.wait(left)
            self.limiter.sampled += batch_size
            self.cond.notify_all()  # the inserter may be waiting for room in the band
            draw = self._draw(*got)
            if draw.rows is None:  # a device table gathered under the lock
                try:
                    return self._batch(draw)
                finally:
                    draw.staging.claimed = False
            self.gate.begin_gather()
        try:
            gather_rows(list(zip(draw.table.rows, draw.staging.fields)), draw.rows, split)
            return self._batch(draw)
        finally:
            with self.cond:
                draw.staging.claimed = False  # the batch's tensors hold it now (or nobody does)
                self.gate.end_gather()

    def timed_out(self, timeout: float) -> RLinkTimeout:
        """The error of a sample that waited ``timeout`` seconds in vain, saying why."""
        return RLinkTimeout(f"sample timed out after {timeout:.3g}s: " + self._why_waiting(timeout))

    def _why_waiting(self, timeout: float | None) -> str:
        held, batch_size = (self.table.held if self.table is not None else 0), self.settings.batch_size
        what = f"{held} steps held"
        if self.table is None:
            return what + " (no actor has sent a schema yet)"
        if held < self.limiter.min_size:
            return what + f", min_size is {self.limiter.min_size}"
        if self.limiter.samples_per_insert is not None and not self.limiter.can_sample(batch_size, held):
            return what + " (the samples_per_insert rate limiter waits for inserts)"
        return what + f" (not enough items for a batch of {batch_size})"

    def _staging(self, rows: int) -> Staging:
        """A free staging set for ``rows`` rows, claimed (lock held)."""
        assert self.table is not None
        s = self.settings
        fields = not (self.table.on_device and s.cuda)  # a CUDA gather makes its own tensors
        return self.pool.take(self.table, rows, s.batch_size, s.pin, fields)

    def _draw(self, ids: np.ndarray, weights: np.ndarray) -> Draw:
        """Everything of the batch of ``ids`` but the host rows' bytes (lock held): its staging,
        metadata, and the storage rows to copy; a device table gathers here."""
        table = self.table
        assert table is not None
        every = table.window_ids(ids) if self.settings.sequence_length else ids
        staging = self._staging(every.size)
        draw = Draw(table, staging, len(ids))
        if isinstance(table, DeviceTable):
            draw.tensors = table.gather_device(every, staging.fields, staging.slots)
        else:
            draw.rows = table.storage_rows(every)
        version, actor_id, seq = table.meta(every.ravel())
        meta = staging.meta
        meta[0], meta[1], meta[2] = version, actor_id, seq
        np.subtract(self.version(), meta[0], out=meta[3])
        staging.index[:] = ids
        staging.weight[:] = weights
        return draw

    def _batch(self, draw: Draw) -> Batch:
        table, staging, s = draw.table, draw.staging, self.settings
        lead = (draw.items, table.window) if s.sequence_length else (draw.items,)
        if self.torch is None:  # a host table's staging handed out as numpy, JAX or TensorFlow arrays
            host = {spec.name: Host(typed(raw.reshape(-1), spec.dtype, (*lead, *spec.shape)), spec.dtype)
                    for spec, raw in zip(table.schema.fields, staging.fields)}  # fmt: skip
            v, a, q, st = (Host(row, "int64") for row in staging.meta.reshape(4, *lead))
            return Batch(host, version=v, actor_id=a, seq=q, staleness=st, index=Host(staging.index, "int64"),
                         weight=Host(staging.weight, "float32"), convert=self.adapter.array)  # fmt: skip
        torch = self.torch
        rows = draw.tensors if draw.rows is None else [torch.from_numpy(host) for host in staging.fields]
        fields = {
            spec.name: typed_view(raw, dtype, *lead, *spec.shape)
            for spec, raw, dtype in zip(table.schema.fields, rows, self._dtypes)
        }
        m = torch.from_numpy(staging.meta).view(4, *lead)
        index, weight = torch.from_numpy(staging.index), torch.from_numpy(staging.weight)
        if s.cuda:
            if not table.on_device:
                fields = {k: v.to(s.device, non_blocking=True) for k, v in fields.items()}
            m, index, weight = (x.to(s.device, non_blocking=True) for x in (m, index, weight))
            staging.copied = torch.cuda.Event()
            staging.copied.record(torch.cuda.current_stream(s.device))
        return Batch(fields, version=m[0], actor_id=m[1], seq=m[2], staleness=m[3], index=index, weight=weight)

    def update_priorities(self, index: Any, priorities: Any) -> None:
        ids = _numpy(index).astype(np.int64, copy=False).reshape(-1)
        p = _checked(_numpy(priorities), ids.size)
        with self.cond:
            if self.sampler is not None:
                self.sampler.update(ids, p)

    # --- pausing for a checkpoint ---------------------------------------------------------------
    def pause(self) -> None:
        """Stop inserts (they wait, and so do the actors) and wait for one in flight."""
        self.gate.pause()

    def resume(self) -> None:
        """Let inserts go on after :meth:`pause`."""
        self.gate.resume()


@dataclass
class _Swap:
    """A block table insert's plan, made under the lock: per chunk group, the ``(row, count)``
    runs to copy into and the free block lent to the ring in the chunk's place (or None)."""

    table: BlockTable
    groups: list[ChunkGroup]
    plan: list[list[tuple[int, int]]]
    lends: list[int | None]


def _again(exc: BaseException) -> BaseException:
    """A fresh error of the inserter's type for this caller, with the original as its cause."""
    try:
        again = type(exc)(f"the replay stopped receiving: {exc}")
    except Exception:  # noqa: BLE001 - a type that takes other arguments: say it plainly
        again = Closed(f"the replay stopped receiving: {exc!r}")
    again.__cause__ = exc
    return again


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, maybe on a GPU
        array: np.ndarray = x.detach().cpu().numpy()
        return array
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"expected an array or tensor, got {type(x).__name__}") from exc

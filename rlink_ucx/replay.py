"""ReplayDataset: keep the actors' steps in a table on the learner and sample them."""

from __future__ import annotations

import os
import weakref
from typing import Any, Self

from .batch import Batch
from .dataset import in_dataloader_worker
from .errors import Closed, ConfigError, SchemaMismatch
from .learner import Learner, StepFeed
from .store.replay.checkpoint import CheckpointError, read_manifest, restore, save
from .store.replay.core import ReplayCore, stored_schema
from .store.replay.inserter import Inserter
from .store.replay.limiter import RateLimiter
from .store.replay.sample_ahead import SampleAhead
from .wire.frameworks import Adapter, adapter

__all__ = ["CheckpointError", "ReplayDataset"]

try:
    from torch.utils.data import IterableDataset
except ImportError:  # no torch: a plain iterable (RLinkDataset does the same)
    IterableDataset = object  # type: ignore[misc, assignment]

_SAMPLERS = ("uniform", "prioritized", "fifo")
_PREFETCH = 2  # batches drawn ahead by default (where allowed): one per drawing thread
_STORAGES = ("host", "device")


class ReplayDataset(IterableDataset):  # type: ignore[type-arg]
    """A replay table of the last ``capacity`` steps the actors put, sampled in batches.

    Steps arrive from the learner exactly as for :class:`RLinkDataset` (same ``put``, planes and
    credits), are inserted in arrival order, and the oldest is evicted when the table is full.

    Args:
        learner: the :class:`Learner` whose actors fill the table. Read it through one dataset
            only (a ``RLinkDataset`` on the same learner would take steps away from it).
        capacity: steps held at most (preallocated when the first actor's schema is known).
        batch_size: items per :meth:`sample`.
        sampler: ``"uniform"`` (with replacement), ``"prioritized"`` (P(i) proportional to
            ``priority ** priority_exponent``, a sum tree) or ``"fifo"`` (each step once, in
            order; a step is never evicted before it was handed out, so the actors wait instead).
        sequence_length: T: each item is a window of T consecutive steps of one actor's stream
            (same actor, consecutive ``seq``; never across actors or a gap); fields come as
            ``[B, T, ...]``. Windows may cross an episode end: your ``done`` field shows where.
        priority_exponent: alpha, for ``"prioritized"``.
        importance_exponent: beta: ``batch.weight = (N * P(i)) ** -beta``, normalized by the
            batch's largest weight (1.0 unless prioritized).
        samples_per_insert: the rate limiter (Reverb's ``SampleToInsertRatio``): with
            ``s = samples_per_insert``, ``m = min_size`` and ``e = spi_tolerance``, ``diff = s *
            inserted - sampled`` stays within ``s*m +- e`` (a batch of B counts B items; a window
            counts 1). A sample that would leave the band blocks; an insert that would leave it
            waits, so the learner stops granting credit and the actors slow down (nothing is
            dropped). Off when None.
        spi_tolerance: e, in samples (default ``batch_size + samples_per_insert``, the least
            that can never block both sides at once).
        min_size: no sample before this many steps are held.
        device: where batches are returned, as ``format``'s framework names it (torch:
            ``"cpu"`` or ``"cuda:N"``, copied there asynchronously from pinned host staging
            unless ``storage="device"``; JAX: a device or ``"cpu"`` / ``"gpu:N"``; TensorFlow: a
            device string).
        format: the framework of the batch's arrays (fields, metadata, ``index``, ``weight``):
            ``"torch"`` (the default where torch is installed), ``"numpy"`` (the default
            without), ``"jax"`` or ``"tensorflow"``; as for :class:`RLinkDataset`. One that is
            not installed is a :class:`ConfigError` here. ``storage="device"`` is torch only.
        storage: ``"host"`` (default): the table's fields live in host memory (pinned where CUDA
            exists) and a sample is gathered there. ``"device"``: they live on ``device`` as
            torch tensors and a sample is a gather on the device, with no host round trip of
            the step bytes (the table must fit in the device's memory; the ids, weights and
            metadata stay in host memory). With ``device="cpu"`` it works too, as CPU tensors.
        timeout: default seconds :meth:`sample` waits (``Config.fetch_timeout`` if None).
        seed: seeds the sampler's random generator (for reproducible tests).
        prefetch: batches drawn ahead of :meth:`sample` by two background threads that gather
            side by side (``store/replay/sample_ahead.py``): sampling overlaps your training step and
            reaches more of the memory bandwidth. None (default): 2 where nothing but timing
            changes, i.e. the ``"uniform"`` sampler, no ``samples_per_insert``, no ``seed``, a
            host table, batches on the CPU, and more than one CPU; else 0. A batch drawn ahead
            may hold items evicted before :meth:`sample` returns it (as Reverb's in-flight
            samples may). 0 turns it off.

    Priorities from actors: ``actor.put(step, priority=p)`` / ``actor.put_many(steps,
    priority=array)``. An actor passes a priority on every put or on none (it is a field of
    the actor's schema); a step without one gets the highest priority seen so far.

    Example::

        replay = ReplayDataset(learner, capacity=100_000, batch_size=256, sampler="prioritized")
        batch = replay.sample(timeout=30)
        loss = (batch.weight * td_error ** 2).mean()
        replay.update_priorities(batch.index, td_error.abs())
    """

    def __init__(self, learner: Learner, *, capacity: int, batch_size: int, sampler: str = "uniform",
                 sequence_length: int | None = None, priority_exponent: float = 0.6,
                 importance_exponent: float = 0.4, samples_per_insert: float | None = None,
                 spi_tolerance: float | None = None, min_size: int = 1, device: Any = "cpu",
                 timeout: float | None = None, seed: int | None = None, storage: str = "host",
                 prefetch: int | None = None, format: str | None = None,
                 _checkpoint: str | None = None):  # fmt: skip
        _check(capacity, batch_size, sampler, sequence_length, priority_exponent, importance_exponent, min_size)
        if storage not in _STORAGES:
            raise ConfigError(f"storage must be one of {_STORAGES}, got {storage!r}")
        self._adapter = adapter(format, device)  # ConfigError: not installed, or no such device
        self.format = self._adapter.format
        self.device = self._adapter.device
        self.storage = storage
        if storage == "device" and self.format != "torch":
            raise ConfigError(f'storage="device" keeps the table in torch tensors: use format="torch", not {self.format!r}')
        ahead_blocked = _why_not_ahead(sampler, samples_per_insert, seed, storage, self._adapter)
        if prefetch is None:
            prefetch = 0 if ahead_blocked or (os.cpu_count() or 1) < 2 else _PREFETCH
        elif prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {prefetch}")
        elif prefetch and ahead_blocked:
            raise ConfigError(f"prefetch works only where drawing early changes nothing but timing: {ahead_blocked}")
        self.prefetch = prefetch
        limiter = RateLimiter.create(min_size, samples_per_insert, spi_tolerance, batch_size)
        self.learner = learner
        self.batch_size = batch_size
        self.timeout = timeout
        self._settings = {"capacity": capacity, "batch_size": batch_size, "sampler": sampler,
                          "sequence_length": sequence_length, "priority_exponent": priority_exponent,
                          "importance_exponent": importance_exponent, "samples_per_insert": samples_per_insert,
                          "spi_tolerance": spi_tolerance, "min_size": min_size}  # fmt: skip
        self._core = ReplayCore(capacity=capacity, batch_size=batch_size, sampler=sampler,
                                sequence_length=sequence_length, alpha=priority_exponent, beta=importance_exponent,
                                limiter=limiter, adapter=self._adapter, version=lambda: learner.version,
                                seed=seed, storage=storage)  # fmt: skip
        # Ring chunks of a batch: large enough that a host table of large steps takes whole ones
        # without copying them (no effect once the learner's ring exists).
        self._feed = feed = learner.feed(exclusive=True)  # its inserter takes every step
        feed.hint_batch_size(batch_size)
        try:
            self._restore(feed, _checkpoint)
        except BaseException:
            feed.release()  # a replay that failed to start leaves the learner as it was
            raise
        self._inserter = Inserter(self._core, feed.wait_ring)
        self._inserter.start()
        self._ahead: SampleAhead | None = None
        if prefetch:
            self._ahead = SampleAhead(self._core, depth=prefetch, threads=min(2, prefetch))
            weakref.finalize(self, self._ahead.close)  # a dropped replay stops its threads
        feed.on_close(self.close)  # a closed learner stops and joins them

    def _restore(self, feed: StepFeed, checkpoint: str | None) -> None:
        """Fill the table from ``checkpoint`` (none: start empty), checking its schema against
        the one the learner's actors already sent, if any."""
        if checkpoint is None:
            return
        ring = feed.wait_ring(0.0)  # the learner already knows its actors' schema: check it now
        if ring is not None:
            self._core.ring_geometry = (ring.chunk_steps, ring.capacity)
        restore(self._core, checkpoint, read_manifest(checkpoint))
        if ring is not None and self._core.table is not None and stored_schema(ring.schema) != self._core.table.schema:
            raise SchemaMismatch(f"the checkpoint's schema {self._core.table.schema.describe()} does not match "
                                 f"the learner's {stored_schema(ring.schema).describe()}")  # fmt: skip

    # --- sampling ---------------------------------------------------------------------------------
    def sample(self, timeout: float | None = None) -> Batch:
        """A batch of ``batch_size`` items, with ``batch.index`` and ``batch.weight``.

        Raises:
            TimeoutError: no batch could be sampled within ``timeout`` (too few steps held, or the
                rate limiter waits for inserts).
            Closed: the replay was closed, or the learner closed and no batch is possible.
            SchemaMismatch: the actors' schema differs from a loaded checkpoint's.
        """
        if timeout is None:
            timeout = self.timeout if self.timeout is not None else self.learner.config.fetch_timeout
        if self._ahead is not None:
            return self._ahead.get(timeout)
        return self._core.sample(timeout)

    def update_priorities(self, index: Any, priorities: Any) -> None:
        """Set the priorities of the items ``index`` (from ``batch.index``); ids evicted since
        they were sampled are ignored. Without the prioritized sampler the values are checked,
        then ignored.

        Raises:
            ConfigError: lengths differ, or a priority is negative, NaN or infinite (nothing changes).
        """
        self._core.update_priorities(index, priorities)

    def __len__(self) -> int:
        """Steps held now."""
        table = self._core.table
        return 0 if table is None else table.held

    @property
    def inserted(self) -> int:
        """Steps ever inserted (held or evicted)."""
        table = self._core.table
        return 0 if table is None else table.inserted

    @property
    def sampled(self) -> int:
        """Items ever drawn (what the rate limiter counts); with ``prefetch``, this includes the
        batches drawn ahead and not returned yet."""
        return self._core.limiter.sampled

    def __iter__(self) -> Any:
        if in_dataloader_worker():
            raise ConfigError(
                "ReplayDataset must be read in the learner process: use DataLoader(dataset, batch_size=None, num_workers=0)"
            )
        while not self.learner.closed:
            try:
                yield self.sample()
            except Closed:
                return

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a consistent snapshot to the directory ``path`` (replaced if it exists).

        Inserts pause while the fields stream to disk (the actors wait on credit, nothing is
        dropped); sampling goes on. On a learner rank of a job of many (``distributed=True``),
        each rank writes its own table to ``path/rank-<r>`` (call it on every rank).
        """
        save(self._core, rank_path(path, self.learner), self._settings)

    @classmethod
    def load(cls, path: str | os.PathLike[str], learner: Learner, *, device: Any = "cpu",
             timeout: float | None = None, seed: int | None = None, storage: str = "host",
             prefetch: int | None = None, format: str | None = None) -> ReplayDataset:  # fmt: skip
        """A replay restored from ``path`` (settings, steps, priorities, counters, rate limiter)
        that goes on receiving from ``learner``'s actors. ``device``, ``storage`` and
        ``prefetch`` and ``format`` are chosen here, whatever they were when it was saved.

        Raises:
            CheckpointError: missing, truncated or corrupted files, or another format.
            SchemaMismatch: the learner's actors send another schema than the checkpoint's.
        """
        path = rank_path(path, learner)  # a rank of a job of many: its own table
        settings = read_manifest(path)["settings"]
        try:
            return cls(learner, **settings, device=device, timeout=timeout, seed=seed, storage=storage,
                       prefetch=prefetch, format=format, _checkpoint=os.fspath(path))  # fmt: skip
        except TypeError as exc:
            raise CheckpointError(f"{path}: bad settings in the manifest: {exc}") from exc

    # --- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop receiving and join this replay's threads (the learner stays open). Idempotent;
        closing the learner closes it too."""
        if self._ahead is not None:
            self._ahead.close(self.learner.config.close_timeout)
        self._inserter.stop(self.learner.config.close_timeout)
        self._feed.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._settings
        return (f"ReplayDataset(capacity={s['capacity']}, batch_size={s['batch_size']}, sampler={s['sampler']!r}, "
                f"storage={self.storage!r}, device={str(self.device)!r}, held={len(self)}, inserted={self.inserted})")  # fmt: skip


def _why_not_ahead(sampler: str, samples_per_insert: float | None, seed: int | None, storage: str,
                   target: Adapter) -> str:  # fmt: skip
    """Why batches may not be drawn ahead of ``sample()`` here ("" where they may)."""
    if sampler != "uniform":
        return f'the "{sampler}" sampler depends on what happened since (priorities, order)'
    if samples_per_insert is not None:
        return "samples_per_insert would count draws the caller did not ask for"
    if seed is not None:
        return "with a seed, batches must come in the order they were drawn"
    if storage != "host" or not target.host:
        return "only a host table with batches on the CPU"
    return ""


def _check(capacity: int, batch_size: int, sampler: str, sequence_length: int | None, alpha: float, beta: float,
           min_size: int) -> None:  # fmt: skip
    if sampler not in _SAMPLERS:
        raise ConfigError(f"sampler must be one of {_SAMPLERS}, got {sampler!r}")
    if batch_size <= 0 or capacity <= 0:
        raise ConfigError("capacity and batch_size must be positive")
    if capacity < batch_size:
        raise ConfigError(f"capacity {capacity} is smaller than batch_size {batch_size}")
    if sequence_length is not None:
        if sequence_length < 1:
            raise ConfigError("sequence_length must be >= 1")
        if sequence_length > capacity:
            raise ConfigError(f"sequence_length {sequence_length} exceeds capacity {capacity}")
        if sampler == "fifo":
            raise ConfigError('sequence_length works with the "uniform" and "prioritized" samplers, not "fifo"')
    if not alpha >= 0 or not beta >= 0:
        raise ConfigError("priority_exponent and importance_exponent must be >= 0")
    if min_size > capacity:
        raise ConfigError(f"min_size {min_size} exceeds capacity {capacity}: sampling could never start")


def rank_path(path: str | os.PathLike[str], learner: Learner) -> str:
    """Where ``learner``'s table is kept under ``path``: ``path`` itself for a lone learner,
    ``path/rank-<r>`` for rank r of a job of many (one checkpoint per rank under one path)."""
    if learner.world_size == 1:
        return os.fspath(path)
    return os.path.join(os.fspath(path), f"rank-{learner.rank}")

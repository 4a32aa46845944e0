"""RLinkDataset: the learner's batches, as a ``torch.utils.data.IterableDataset`` where torch is
installed (a plain iterable without it), in torch, numpy, JAX or TensorFlow arrays."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Self

from .batch import Batch
from .config import Config
from .errors import Closed, ConfigError
from .errors import TimeoutError as RLinkTimeout
from .learner import Learner, StepFeed
from .store.gather import BatchAssembler
from .store.lockstep import take_one_per_actor
from .store.ring import Piece, StepRing
from .transport.address import DEFAULT_PORT
from .wire.frameworks import adapter

__all__ = ["RLinkDataset"]

try:
    from torch.utils.data import IterableDataset, get_worker_info
except ImportError:  # no torch: the datasets are plain iterables (format "numpy", "jax", "tensorflow")
    IterableDataset = object  # type: ignore[misc, assignment]

    def get_worker_info() -> Any:
        return None


def in_dataloader_worker() -> bool:
    """True inside a torch DataLoader worker process (the datasets refuse to be read there)."""
    return get_worker_info() is not None


class RLinkDataset(IterableDataset):  # type: ignore[type-arg]
    """Batches of actor steps, already on ``device``, in arrival order (each step once).

    Args:
        learner: the :class:`Learner` to read from. When omitted, a learner is created on
            ``address`` (default ``127.0.0.1:8443``) and closed with the dataset; ``token``,
            ``transport``, ``config`` and ``insecure`` are passed to it.
        batch_size: steps per batch.
        format: the framework of the batch's arrays (fields and metadata): ``"torch"`` (the
            default), ``"numpy"``, ``"jax"`` or ``"tensorflow"``. A framework that is not
            installed is a :class:`ConfigError` here, naming the extra to install. Arrays come
            from rlink's staging memory without a copy where the framework takes a view
            (``docs/frameworks.md`` says where a copy is made and why). Without torch installed
            the default is ``"numpy"``.
        device: where the arrays live, as the framework names it: for torch ``"cpu"`` or
            ``"cuda:N"`` (``gpu_id=N`` is shorthand for ``"cuda:N"``); for JAX a device or
            ``"cpu"`` / ``"gpu:N"``; for TensorFlow a device string (``"/GPU:0"``); numpy: ``"cpu"``.
        timeout: default seconds ``fetch`` waits (``Config.fetch_timeout``, 300 s, if None).
            With None, iterating waits for steps as long as the learner is open, so a learner
            started before its actors waits for them; with a number, iteration raises
            :class:`TimeoutError` as ``fetch`` does.
        max_staleness: drop (and count, see ``learner.stats()["staleness"]``) steps whose
            behaviour version is more than this many versions behind ``learner.version``.
        stop_when_actors_done: end the stream once every actor that connected has closed
            (an actor that crashed may still reconnect: it is waited for up to
            ``Config.reconnect_timeout``; one that has not connected yet does not count). Iteration then stops; ``fetch`` returns the last,
            shorter batch, then raises :class:`Closed`. Off by default: actors may come later.
        drop_last: with ``stop_when_actors_done``, drop a last batch shorter than
            ``batch_size`` instead of returning it (as ``DataLoader(drop_last=True)``).
        time_major: fields with a time axis (a step that is a whole rollout, ``obs[T, ...]``)
            come as ``[T, B, ...]`` instead of ``[B, T, ...]`` (a contiguous copy); fields of one
            value per step and the metadata (``batch.version``, ...) stay ``[B]``. A per-step
            field of shape ``(k,)`` counts as a time axis too.

    A fetch that waits while no actor streams steps (none connected yet, or every one has gone)
    warns once (:class:`UserWarning`, the ``warnings`` module) after ``Config.fetch_warn_after``
    seconds (5 s), then keeps waiting until its timeout.

    Iteration also stops when the learner is closed.

    Use it directly (``dataset.fetch()``, ``for batch in dataset``) or, with torch, through
    ``DataLoader(dataset, batch_size=None, num_workers=0)``: batching is already done and the
    connection lives in this process, so DataLoader worker processes are refused.

    Example::

        learner = Learner("127.0.0.1:0")
        dataset = RLinkDataset(learner, batch_size=256, device="cpu")
        batch = dataset.fetch(timeout=30)
        batch["obs"].shape, batch.version, batch.staleness
    """

    def __init__(self, learner: Learner | None = None, *, batch_size: int = 256, device: Any = "cpu",
                 gpu_id: int | None = None, format: str | None = None, timeout: float | None = None, address: str | None = None,
                 token: str | bytes | None = None, transport: str = "auto", config: Config | None = None,
                 max_staleness: int | None = None, stop_when_actors_done: bool = False,
                 drop_last: bool = False, insecure: bool = False, time_major: bool = False):  # fmt: skip
        if batch_size <= 0:
            raise ConfigError("batch_size must be positive")
        if gpu_id is not None:
            device = f"cuda:{gpu_id}"
        self._adapter = adapter(format, device)  # ConfigError: not installed, or no such device
        self.format = self._adapter.format
        self.device = self._adapter.device
        self._owns_learner = learner is None
        if learner is None:
            learner = Learner(address or f"127.0.0.1:{DEFAULT_PORT}", token=token, transport=transport, config=config,
                              insecure=insecure)  # fmt: skip
        self.learner = learner
        self.batch_size = batch_size
        self.timeout = timeout
        if max_staleness is not None and max_staleness < 0:
            raise ConfigError("max_staleness must be >= 0")
        self.max_staleness = max_staleness
        self.stop_when_actors_done = stop_when_actors_done
        self.drop_last = drop_last
        self.time_major = time_major
        self._feed = learner.feed()
        if self._adapter.cuda:
            self._feed.request_pinned()
        self._feed.hint_batch_size(batch_size)
        self._assembler: BatchAssembler | None = None
        self._lock = threading.Lock()
        self._feed.on_close(self._stop_threads)
        self.batches = 0

    def fetch(self, timeout: float | None = None, *, one_per_actor: bool = False,
              min_actors: int | None = None) -> Batch:  # fmt: skip
        """Block until ``batch_size`` steps are ready and return them as a :class:`Batch`.

        Args:
            timeout: seconds to wait (default: the dataset's ``timeout``, else
                ``Config.fetch_timeout``).
            one_per_actor: on-policy lockstep instead of ``batch_size`` steps in arrival order:
                the batch holds exactly one step (the oldest it has pending) from each actor
                streaming to this learner now, in actor id order, however many that is
                (``batch_size`` does not limit it). It waits up to ``timeout`` for every such
                actor; an actor that left is not waited for (its steps already here are
                taken). Once the timeout passes, it returns what it has if at least
                ``min_actors`` actors have a step there: ``batch.actor_id`` says who is in it.
                Steps an actor puts meanwhile wait for the next fetch, in order. With
                ``stop_when_actors_done``, once the stream ended what is here is returned,
                then :class:`Closed` raised.
            min_actors: with ``one_per_actor``, the fewest actors a batch may hold (default 1):
                it also keeps a first fetch from returning while the other actors are still
                connecting.

        Raises:
            TimeoutError: fewer than ``batch_size`` steps (with ``one_per_actor``: steps from
                fewer than ``min_actors`` actors) arrived within ``timeout``.
            Closed: the learner was closed, or (``stop_when_actors_done``) the stream ended.
            ConfigError: ``min_actors`` without ``one_per_actor``, or below 1.
        """
        if min_actors is not None and (not one_per_actor or min_actors < 1):
            raise ConfigError(f"min_actors={min_actors!r} needs one_per_actor=True and must be >= 1")
        if timeout is None:
            timeout = self.timeout if self.timeout is not None else self.learner.config.fetch_timeout
        started = time.monotonic()
        deadline = started + timeout
        watch = _AbsenceWatch(self._feed, started, self.learner.config.fetch_warn_after)
        with self._lock:
            if self.learner.closed:
                raise Closed("the learner is closed")
            assembler = self._assembler
            if assembler is None:
                assembler = self._assembler = self._first_assembler(timeout, deadline, watch)
            version = self.learner.version
            min_version = 0 if self.max_staleness is None else version - self.max_staleness
            ring = assembler.ring
            if one_per_actor:
                finished = self._feed.actors_done if self.stop_when_actors_done else None
                pieces, take_id = take_one_per_actor(ring, self._feed.streaming_actors, max(0.0, deadline - time.monotonic()),
                                                     min_actors or 1, min_version, watch, finished)  # fmt: skip
                assembler = self._fitting(len(pieces))
            else:
                pieces, take_id = self._take_in_order(ring, deadline, min_version, watch)
            batch = assembler.assemble(pieces, take_id, version)
            if self.time_major:
                batch = batch.time_major()
            counts: dict[int, int] = {}
            for p in pieces:
                counts[version - p.version] = counts.get(version - p.version, 0) + p.count
            self._feed.record_staleness(counts)
            self._feed.record_fetch(pieces, started)
            self.batches += 1
            return batch

    def _first_assembler(self, timeout: float, deadline: float, watch: _AbsenceWatch) -> BatchAssembler:
        """Wait for the ring (the first schema), warning while no actor comes."""
        ring = None
        while ring is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RLinkTimeout(f"fetch timed out after {time.monotonic() - watch.started:.3g}s: no actor has sent a schema yet")
            ring = self._feed.wait_ring(min(left, 1.0, max(0.1, watch.at - time.monotonic())))
            if ring is None:
                watch()
        if self.batch_size > ring.capacity - ring.max_frame_steps:
            raise ConfigError(
                f"batch_size {self.batch_size} does not fit the learner buffer "
                f"({ring.capacity} steps); raise Config.buffer_bytes"
            )
        return BatchAssembler(ring, self.batch_size, self._adapter)

    def _fitting(self, n: int) -> BatchAssembler:
        """An assembler for ``n`` steps: a one-per-actor batch of more actors than ``batch_size``
        gets one of its size (kept for the next batches)."""
        assembler = self._assembler
        assert assembler is not None
        if n > assembler.batch_size:
            assembler.close(self.learner.config.close_timeout)
            assembler = self._assembler = BatchAssembler(assembler.ring, n, self._adapter)
        return assembler

    def _take_in_order(self, ring: StepRing, deadline: float, min_version: int,
                       watch: _AbsenceWatch) -> tuple[list[Piece], int]:  # fmt: skip
        """``batch_size`` steps in arrival order. Until the absence warning is settled the wait
        claims nothing and wakes every second to look (an actor leaving wakes it too)."""
        finished = self._feed.actors_done if self.stop_when_actors_done else None
        count = self.batch_size
        while not watch.done and (now := time.monotonic()) < deadline:
            ready, _ = ring.wait_ready(count, min(deadline, max(watch.at, now + 1.0)) - now, finished)
            if ready >= count or (finished is not None and finished()):
                break
            watch()
        try:
            return ring.take(count, max(0.0, deadline - time.monotonic()), min_version, finished=finished,
                             partial=not self.drop_last)  # fmt: skip
        except RLinkTimeout as exc:
            raise RLinkTimeout(f"fetch timed out after {time.monotonic() - watch.started:.3g}s with {ring.ready_steps()} "
                               f"of {count} steps ready") from exc  # fmt: skip

    def __iter__(self) -> Any:
        if in_dataloader_worker():
            raise ConfigError(
                "RLinkDataset must be read in the learner process: use DataLoader(dataset, batch_size=None, num_workers=0)"
            )
        while True:
            try:
                yield self.fetch()
            except Closed:
                return
            except RLinkTimeout:
                if self.timeout is not None:
                    raise

    def close(self) -> None:
        """Stop this dataset's threads, and close the learner if this dataset created it.
        Idempotent; closing the learner closes the dataset too."""
        self._stop_threads()
        self._feed.release()
        if self._owns_learner:
            self.learner.close()

    def _stop_threads(self) -> None:
        # Without the fetch lock: a fetch waiting for steps holds it until the learner closes.
        assembler = self._assembler
        if assembler is not None:
            assembler.close(self.learner.config.close_timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AbsenceWatch:
    """One fetch's warning that no actor streams steps, due at ``at`` (``time.monotonic()``):
    called each time the wait wakes, it warns once, if no actor streams then."""

    __slots__ = ("_feed", "at", "done", "started")

    def __init__(self, feed: StepFeed, started: float, after: float):
        self._feed = feed
        self.started = started
        self.at = started + after
        self.done = False

    def __call__(self) -> None:
        if self.done or time.monotonic() < self.at or self._feed.streaming_actors():
            return
        self.done = True
        # stacklevel: this call, the wait that made it, fetch, and fetch's caller
        warnings.warn(f"rlink: fetch has waited {time.monotonic() - self.started:.0f}s and no actor is streaming steps: "
                      f"{self._feed.absence()}", UserWarning, stacklevel=4)  # fmt: skip


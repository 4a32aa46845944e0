"""RLinkDataset: the learner's batches, as a ``torch.utils.data.IterableDataset`` where torch is
installed (a plain iterable without it), in torch, numpy, JAX or TensorFlow arrays."""

from __future__ import annotations

import threading
import time
from typing import Any, Self

from .batch import Batch
from .config import Config
from .errors import Closed, ConfigError
from .errors import TimeoutError as RLinkTimeout
from .learner import Learner
from .store.gather import BatchAssembler
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
                 drop_last: bool = False, insecure: bool = False):  # fmt: skip
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
        self._feed = learner.feed()
        if self._adapter.cuda:
            self._feed.request_pinned()
        self._feed.hint_batch_size(batch_size)
        self._assembler: BatchAssembler | None = None
        self._lock = threading.Lock()
        self._feed.on_close(self._stop_threads)
        self.batches = 0

    def fetch(self, timeout: float | None = None) -> Batch:
        """Block until ``batch_size`` steps are ready and return them as a :class:`Batch`.

        Raises:
            TimeoutError: fewer than ``batch_size`` steps arrived within ``timeout``.
            Closed: the learner was closed, or (``stop_when_actors_done``) the stream ended.
        """
        if timeout is None:
            timeout = self.timeout if self.timeout is not None else self.learner.config.fetch_timeout
        started = time.monotonic()
        deadline = started + timeout
        with self._lock:
            if self.learner.closed:
                raise Closed("the learner is closed")
            assembler = self._assembler
            if assembler is None:
                ring = self._feed.wait_ring(timeout)
                if ring is None:
                    raise RLinkTimeout(
                        f"fetch timed out after {time.monotonic() - started:.3g}s: no actor has sent a schema yet"
                    )
                if self.batch_size > ring.capacity - ring.max_frame_steps:
                    raise ConfigError(
                        f"batch_size {self.batch_size} does not fit the learner buffer "
                        f"({ring.capacity} steps); raise Config.buffer_bytes"
                    )
                assembler = self._assembler = BatchAssembler(ring, self.batch_size, self._adapter)
            version = self.learner.version
            min_version = 0 if self.max_staleness is None else version - self.max_staleness
            ring = assembler.ring
            finished = self._feed.actors_done if self.stop_when_actors_done else None
            try:
                pieces, take_id = ring.take(self.batch_size, max(0.0, deadline - time.monotonic()), min_version,
                                            finished=finished, partial=not self.drop_last)  # fmt: skip
            except RLinkTimeout as exc:
                # The whole call's wait, not the part left after the first schema arrived.
                raise RLinkTimeout(f"fetch timed out after {time.monotonic() - started:.3g}s with {exc}") from exc
            batch = assembler.assemble(pieces, take_id, version)
            counts: dict[int, int] = {}
            for p in pieces:
                counts[version - p.version] = counts.get(version - p.version, 0) + p.count
            self._feed.record_staleness(counts)
            self._feed.record_fetch(pieces, started)
            self.batches += 1
            return batch

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

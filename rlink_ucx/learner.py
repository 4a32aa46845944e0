"""The learner: accepts actors, buffers their steps, and serves them to datasets."""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Self

from .config import Config, resolve
from .errors import Closed, ConfigError
from .observe.counters import FetchTimings
from .observe.metrics import MetricsServer, require_prometheus, sample
from .session import tokens
from .session.learner.job import Home, Job, join, rank_bind, token_digest
from .session.learner.job import rank_home as job_home
from .session.learner.server import LearnerServer
from .session.tokens import resolve_token
from .store.ring import Piece, StepRing
from .transport import check_transport
from .transport.address import format_address, is_loopback, parse_endpoint
from .transport.loop import IOThread
from .transport.plane import require
from .wire.codec import Schema

log = logging.getLogger(__name__)
_RANK_0 = Home("", 0, b"", b"")  # rank 0 itself: it tells the others, hears nothing

__all__ = ["Learner", "StepFeed"]


class Learner:
    """Accepts actor connections and buffers their steps for :class:`RLinkDataset`.

    Args:
        address: ``host:port`` to listen on (``[::1]:8443`` for IPv6; a ``tcp://``, ``ucx://``,
            ``shm://`` or ``rlink://`` prefix names the transport). Port 0 picks a free port;
            read the real one from :attr:`address`. Binding a non-loopback host requires a token.
        token: shared secret for the mutual HMAC handshake, at least 16 bytes, surrounding
            whitespace ignored (default: ``RLINK_TOKEN`` or the 0600 file named by
            ``RLINK_TOKEN_FILE``; :func:`rlink_ucx.read_token_file` reads such a file). With none, the
            learner generates a strong one and writes it where only its user can read it
            (:attr:`token_file`, see ``Config.token_dir``): the same user's actors that connect
            to a loopback address find it there; other users cannot.
        transport: ``"auto"`` (per actor: ``shm`` on this host, ``ucx`` where UCX has RDMA or
            CUDA transports, ``tcp`` otherwise), or ``"tcp"``, ``"ucx"``, ``"shm"`` for all.
        config: timeouts and caps; defaults from ``RLINK_*`` environment variables.
        schema: optional declaration ``{"obs": ("float32", (4,)), ...}``; otherwise the first
            actor's schema is accepted.
        metrics_port: serve Prometheus metrics over HTTP on this port (0 picks a free one; read
            it from :attr:`metrics_address`). Off (no port opened) when None. Needs the
            ``metrics`` extra (``pip install "rlink-ucx[metrics]"``); docs/operations.md lists
            the metrics.
        metrics_host: where the metrics endpoint listens: loopback unless you name another
            address (the endpoint has no authentication).
        insecure: turn authentication off, so that any local process may connect and stream
            (loopback addresses only, and no token with it).
        distributed: one learner per rank of a torch.distributed job (torchrun, srun, a
            Kubernetes job), called on every rank with the same arguments. It meets the other
            ranks in the default process group where one is initialised (any backend), else in
            one it initialises from the launcher's environment (``RANK``/``WORLD_SIZE`` or
            ``SLURM_PROCID``/``SLURM_NTASKS``, with ``MASTER_ADDR``/``MASTER_PORT``); rlink's
            own traffic goes in a gloo group of its own. Rank 0 binds ``address``, the one
            address actors are given, and sends each actor to a rank (the counts differ by at
            most one; an actor keeps its rank while that rank lives). Every other rank binds an
            address of its own (``Config.rank_host`` / ``rank_port_base``; by default the same
            host where it is this host's, a free port). Each rank's datasets see its own
            actors' steps; call :meth:`publish` on every rank. docs/multi-learner.md.

    Closing the learner (``close()``, the end of a ``with`` block, or the end of the process)
    tells every actor, whose next call then raises :class:`Closed`.

    Example::

        with Learner("127.0.0.1:0") as learner:
            print(learner.address)

    Raises:
        ConfigError: bad address/transport, a non-loopback bind without a token, metrics
            asked for without prometheus_client, or a metrics port that cannot be bound; a
            token shorter than 16 bytes, a token with ``insecure=True``, or no private
            directory for the generated token; ``transport="ucx"`` where ucxx is not installed or
            UCX does not start.
    """

    def __init__(self, address: str = "127.0.0.1:8443", *, token: str | bytes | None = None,
                 transport: str = "auto", config: Config | None = None,
                 schema: dict[str, Any] | Schema | None = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", insecure: bool = False, distributed: bool = False):  # fmt: skip
        self.config = resolve(config)
        check_transport(transport)
        host, port, transport = parse_endpoint(address, transport)  # the address first: a typo is a typo
        require(transport)  # a plane asked for by name that cannot work here: else it would refuse every actor
        self._job: Job | None = None
        self._token: bytes | None = None
        self._server: LearnerServer
        if not distributed:
            self._start(host, port, transport, token, schema, metrics_port, metrics_host, insecure, None)
            return
        self._job = job = join(self.config)  # every rank of the job calls this, in the same order
        error: BaseException | None = None
        try:
            home = job.hear() if job.rank else None
            self._start(host, port, transport, token, schema, metrics_port, metrics_host, insecure, home)
        except Exception as exc:  # noqa: BLE001 - every rank must hear that this one failed; raised below
            error = exc
        try:
            job.agree(None if error is None else f"learner rank {job.rank} of {job.world} did not start: {error}")
        except BaseException as exc:
            if error is None:
                self.close()
            job.close()
            if error is not None and exc.__cause__ is None:
                exc.__cause__ = error
            raise
        log.info("learner rank %d of %d listening on %s", job.rank, job.world, self.address)

    def _start(self, host: str, port: int, transport: str, token: str | bytes | None,
               schema: dict[str, Any] | Schema | None, metrics_port: int | None, metrics_host: str, insecure: bool,
               home: Home | None) -> None:  # fmt: skip
        """Listen (``home``: rank 0's word, for a rank other than 0 of a job of many)."""
        job = self._job
        if job is not None and job.rank == 0 and home is None:
            try:
                self._start(host, port, transport, token, schema, metrics_port, metrics_host, insecure, _RANK_0)
            except BaseException as exc:
                job.tell(Home(str(exc) or type(exc).__name__, 0, b"", b""))
                raise
            job.tell(Home("", self.port, self._token if self._server.publish_token and self._token else b"",
                          token_digest(self._token)))  # fmt: skip
            return
        rank_home: tuple[str, int] | None = None
        advertised = ""
        if job is not None and home is not None and home is not _RANK_0:
            if home.error:
                raise ConfigError(f"rank 0 did not start: {home.error}")
            rank_home = (job_home(host), home.port)
            host, port, advertised = rank_bind(host, rank_home[0], job.rank, self.config)
        self._token = resolve_token(token)
        if rank_home is not None and home is not None:
            if self._token is None and home.token and not insecure:
                self._token = home.token  # rank 0 generated it: the job's ranks share it
            if token_digest(self._token) != home.digest:
                raise ConfigError(f"learner rank {job.rank if job else 0} holds another token than rank 0 (or none, or one "
                                  "runs with insecure=True): give every rank the same RLINK_TOKEN / RLINK_TOKEN_FILE")  # fmt: skip
        if self._token is None and not is_loopback(host):
            only_loopback = (f"insecure=True (--insecure) works on loopback addresses only, not {host!r}; "
                             if insecure else "")  # fmt: skip
            raise ConfigError(
                f"refusing to listen on non-loopback address {host!r} without a token (the data would otherwise be "
                f"open to the network): {only_loopback}give one with token=... (Python), --token-file PATH "
                "(rlink learner) or RLINK_TOKEN_FILE=PATH / RLINK_TOKEN in the environment; make a token file "
                "with `rlink token --file PATH`"
            )
        if insecure and self._token is not None:
            raise ConfigError("insecure=True turns authentication off, but a token was given (token=, RLINK_TOKEN "
                              "or RLINK_TOKEN_FILE): drop one of them")  # fmt: skip
        generated = (self._token is None or (home is not None and self._token == home.token)) and not insecure
        if self._token is None and not insecure:  # written for the same user's local actors once the port is bound
            self._token = tokens.new_token().encode()
        declared = Schema.from_spec(schema) if isinstance(schema, dict) else schema
        if metrics_port is not None:  # before anything starts: nothing to undo
            if not isinstance(metrics_port, int) or not 0 <= metrics_port <= 65535:
                raise ConfigError(f"metrics_port must be a port number (0-65535), got {metrics_port!r}")
            require_prometheus()
        self._closed = False
        self._metrics: MetricsServer | None = None
        self._timings: FetchTimings | None = None  # the dataset and publish() feed it while metrics are on
        self._io = IOThread(name="rlink-learner-io")
        rank, world = (job.rank, job.world) if job is not None else (0, 1)
        self._server = LearnerServer(host, port, token=self._token, transport=transport, config=self.config,
                                     loop=self._io.loop, schema=declared, publish_token=generated, rank=rank,
                                     world=world)  # fmt: skip
        try:  # the UCX plane's own start is bounded by connect_timeout: give it a margin
            self._io.call(self._server.start(), self.config.connect_timeout + self.config.close_timeout, "learner start")
            if rank_home is not None:
                self._io.call(self._server.link_to_rank_0(rank_home, (advertised, self._server.port),
                                                          self.config.connect_timeout),
                              self.config.connect_timeout + self.config.close_timeout, "linking to rank 0")  # fmt: skip
        except TimeoutError as exc:
            self._abort_start()
            raise ConfigError(f"learner rank {rank} could not link to rank 0 at {rank_home}: {exc}") from exc
        except OSError as exc:
            self._abort_start()
            raise ConfigError(f"cannot listen on {format_address(host, port)}: {exc}") from exc
        except BaseException:
            self._abort_start()
            raise
        self._address = format_address(host, self._server.port)
        if metrics_port is not None:  # ranks of a job on one host: a port each
            self._start_metrics(metrics_host, metrics_port + rank if metrics_port else 0)
        # Closes at interpreter exit (so actors hear the learner finished) or when collected.
        # Datasets' close methods, called before the server stops; weak: a dropped dataset's own
        # finalizer stops its threads, and the learner must not keep its memory alive.
        self._closers: list[weakref.WeakMethod[Callable[[], None]]] = []
        self._readers: list[weakref.ref[StepFeed]] = []  # the feeds of the datasets reading this learner
        self._finalizer = weakref.finalize(self, _shutdown, self._server, self._io, self.config, self._metrics,
                                           self._closers, self._job)  # fmt: skip
        if insecure:
            log.warning("learner on %s runs with insecure=True: any local process may connect and stream", self.address)
        log.info("learner listening on %s (transport=%s, auth=%s)", self.address, transport, self._token is not None)

    def _abort_start(self) -> None:
        """Undo a start that failed half-way (the listener, the token file, a UCX plane)."""
        try:
            self._io.call(self._server.stop(), self.config.close_timeout, "learner stop")
        except Exception:  # the error that aborted the start is the one to raise
            log.debug("stopping a learner whose start failed", exc_info=True)
        self._io.stop(self.config.close_timeout)

    @property
    def address(self) -> str:
        """The ``host:port`` the learner listens on, with the real port when 0 was asked for."""
        return self._address

    @property
    def rank(self) -> int:
        """This learner's rank in a job of many (``distributed=True``); 0 for a lone learner."""
        return self._server.rank

    @property
    def world_size(self) -> int:
        """The number of learner ranks in the job (1 for a lone learner)."""
        return self._server.world

    @property
    def port(self) -> int:
        """The port the learner listens on."""
        return self._server.port

    @property
    def token_file(self) -> str | None:
        """Where the generated token was written (None when a token was given, or insecure).
        An actor elsewhere may use a copy of it as ``RLINK_TOKEN_FILE`` (mode 0600)."""
        path = self._server.token_path
        return None if path is None else str(path)

    @property
    def metrics_address(self) -> str | None:
        """The ``host:port`` of the Prometheus endpoint (``http://<it>/metrics``), None when off."""
        return self._metrics.address if self._metrics is not None else None

    def _start_metrics(self, host: str, port: int) -> None:
        timings = FetchTimings()
        server, io, timeout = self._server, self._io, self.config.close_timeout

        async def on_loop() -> dict[str, Any]:
            return sample(server, timings)

        try:  # the snapshot holds the server, not the learner: a dropped learner is still collected
            self._metrics = MetricsServer(host, port, lambda: io.call(on_loop(), timeout, "metrics scrape"),
                                          self._server.rank)  # fmt: skip
        except OSError as exc:
            _shutdown(self._server, self._io, self.config, None, [])
            raise ConfigError(f"cannot serve metrics on {format_address(host, port)}: {exc}") from exc
        except BaseException:
            _shutdown(self._server, self._io, self.config, None, [])
            raise
        self._timings = timings
        log.info("learner metrics on http://%s/metrics", self._metrics.address)

    @property
    def version(self) -> int:
        """The current model version (0 until the first publish)."""
        return self._server.version

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, model_or_state_dict: Any, *, wait: bool = False, timeout: float | None = None) -> int:
        """Publish new parameters to every subscribed actor; returns the new version.

        ``model_or_state_dict``: a torch module or state dict, or a nested mapping (a pytree of
        dicts, as flax keeps params) of numpy, torch, JAX or TensorFlow arrays (anything with
        ``__dlpack__`` or the array interface); actors get the same nesting back
        (``Actor.get_remote_model``). A value that cannot be published raises and changes nothing.

        In a job of many learners (``distributed=True``) call it on every rank with the same
        parameters, as DDP holds them: each rank sends the version to its own actors, so the
        fan-out work is split between the ranks and versions agree across them.

        The tensors are copied first, so training may modify them as soon as this returns; the
        fan-out (the learner's shared memory for actors on its host, each other actor's own
        authenticated weights connection) runs in the background. With ``wait=True``, also wait
        (up to ``timeout``, default ``Config.weights_timeout``) until every live subscriber has
        the version; a slow actor delays only itself, and gets the newest version when it can.
        """
        self._check_open()
        started = time.monotonic()
        version = self._server.publisher.publish(model_or_state_dict, wait=wait, timeout=timeout)
        if self._timings is not None:
            self._timings.publish.observe(time.monotonic() - started)
        return version

    def wait_published(self, version: int | None = None, timeout: float | None = None) -> bool:
        """Wait until every live subscriber has ``version`` (default: the newest); False on timeout."""
        return self._server.publisher.wait(self.version if version is None else version, timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the learner is closed")

    def stats(self) -> dict[str, Any]:
        """Per-actor and total counters, buffer use and the data plane chosen for each actor."""
        if self._closed:
            return {"closed": True}
        return self._io.call(self._snapshot(), self.config.close_timeout, "stats")

    async def _snapshot(self) -> dict[str, Any]:
        return self._server.snapshot()

    def feed(self, *, exclusive: bool = False) -> StepFeed:
        """What a dataset reads from this learner: its receive ring and the bookkeeping of what
        was read (see :class:`StepFeed`). ``RLinkDataset`` and ``ReplayDataset`` take one each.

        ``exclusive``: a reader that takes steps on a thread of its own (``ReplayDataset``), so
        that any other reader beside it would silently get part of the stream: refused while
        another reader is open, and while it is open no other is given.

        Raises:
            ConfigError: an exclusive reader and another one at the same time.
        """
        live = [f for f in (ref() for ref in self._readers) if f is not None and not f.released]
        if any(f.exclusive for f in live) or (exclusive and live):
            raise ConfigError("this learner already has a dataset reading its steps, and a ReplayDataset takes every "
                              "step as it arrives: beside another dataset each would get part of the stream; close "
                              "that one first (dataset.close()), or make a learner per dataset")  # fmt: skip
        feed = StepFeed(self._server, self._timings, lambda: self._closed, self._closers, exclusive)
        self._readers = [ref for ref in self._readers if ref() is not None] + [weakref.ref(feed)]
        return feed

    def close(self) -> None:
        """Tell every actor the learner is finishing (their next call raises ``Closed``),
        disconnect them and stop the I/O thread. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Learner(address={self.address!r}, version={self.version}, closed={self._closed})"


class StepFeed:
    """A learner's steps as a dataset reads them: the receive ring the actors' frames land in,
    and the learner's records of what the dataset took. Get one from :meth:`Learner.feed`.

    One dataset reads a learner: two would take steps from the same ring. The recording calls
    (:meth:`record_staleness`, :meth:`record_fetch`) are made under the dataset's own lock.

    Example::

        feed = learner.feed()
        feed.hint_batch_size(256)
        ring = feed.wait_ring(timeout=30)  # None while no actor has sent a schema
    """

    def __init__(self, server: LearnerServer, timings: FetchTimings | None, closed: Callable[[], bool],
                 closers: list[weakref.WeakMethod[Callable[[], None]]], exclusive: bool = False):  # fmt: skip
        self.exclusive = exclusive
        self._server = server
        self._timings = timings
        self._closed = closed
        self._closers = closers
        self.released = False
        self._freeze_gc = server.config.gc_freeze  # at the first batch (Config.gc_freeze)

    def release(self) -> None:
        """The dataset is done reading (closed): the learner may be read by another one."""
        self.released = True

    def on_close(self, close: Callable[[], None]) -> None:
        """Call the bound method ``close`` when the learner closes, before its server stops, if
        its object is still alive: a dataset's threads are stopped and joined with the learner
        (a thread still inside torch when the interpreter exits aborts the process). ``close``
        must be idempotent: the dataset may be closed first."""
        self._closers.append(weakref.WeakMethod(close))

    def wait_ring(self, timeout: float) -> StepRing | None:
        """The receive ring, once the schema is known (declared, or from the first actor);
        None if it is not known within ``timeout`` seconds.

        Raises:
            Closed: the learner was closed while waiting.
        """
        deadline = time.monotonic() + timeout
        while not self._server.ring_ready.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if self._closed():
                raise Closed("the learner is closed")
            if time.monotonic() >= deadline:
                return None
        return self._server.ring

    def actors_done(self) -> bool:
        """Every actor that connected has left and none is expected back: one that ended
        without a goodbye is waited for up to ``Config.reconnect_timeout``. False before any
        actor connected."""
        return self._server.actors_done()

    def streaming_actors(self) -> set[int]:
        """The ids of the actors connected now that stream steps (negotiated a schema; an actor
        that only reads weights is not one). Any thread: the I/O loop's session table is copied
        in one step."""
        return {s.actor_id for s in list(self._server.sessions.values()) if s.ring is not None}

    def absence(self) -> str:
        """Why no actor streams now, for a warning: none came yet, or every one has gone."""
        ended = len(self._server.ended)
        if not ended:
            return f"no actor has connected to this learner (port {self._server.port}) yet"
        return (f"every actor has gone ({ended} session(s) ended, none connected now); one that crashed may still "
                f"reconnect within Config.reconnect_timeout ({self._server.config.reconnect_timeout:.3g}s)")

    def record_staleness(self, counts: dict[int, int]) -> None:
        """Count a batch's steps by staleness (``{versions behind: steps}``) for ``stats()``."""
        self._server.staleness.record(counts)

    def record_fetch(self, pieces: Sequence[Piece], started: float) -> None:
        """A batch of ring ``pieces`` was handed out by a fetch begun at ``started``
        (``time.monotonic()``); timed for the metrics endpoint when it is on."""
        if self._freeze_gc:
            self._freeze_gc = False
            freeze_gc_once()
        if self._timings is not None:
            self._timings.record_fetch(pieces, started, time.monotonic(), time.time())

    def request_pinned(self) -> None:
        """Ask for a ring in pinned host memory, for fast copies to a GPU (only possible before
        the first actor's schema creates the ring)."""
        self._server.pin_memory = True

    def hint_batch_size(self, batch_size: int) -> None:
        """Size ring chunks to the batch so CPU batches can be lent without a copy (only
        possible before the first actor's schema creates the ring; the first hint wins)."""
        if self._server.batch_steps is None:
            self._server.batch_steps = batch_size


_gc_frozen = False


def freeze_gc_once() -> None:
    """``gc.freeze()``, once per process: by a learner's first batch the process has imported its
    frameworks and built its model, objects that live as long as it does; the collector then
    walks only what came after (``Config.gc_freeze``)."""
    global _gc_frozen
    if not _gc_frozen:
        _gc_frozen = True
        gc.freeze()


def _shutdown(server: LearnerServer, io: IOThread, config: Config, metrics: MetricsServer | None,
              closers: list[weakref.WeakMethod[Callable[[], None]]], job: Job | None = None) -> None:  # fmt: skip
    """Close a learner's datasets, metrics endpoint, server and I/O thread (once: from close(),
    at exit, or when collected)."""
    for ref in closers:
        close = ref()
        try:
            if close is not None:
                close()
        except Exception:  # the learner's own resources are released whatever a dataset does
            log.warning("closing a dataset of the learner failed", exc_info=True)
    closers.clear()
    if metrics is not None:
        metrics.close(config.close_timeout)
    server.publisher.close()
    try:
        io.call(server.stop(), config.close_timeout, "learner close")
    except Exception:  # close must release resources even if the graceful path fails
        log.debug("graceful learner shutdown failed", exc_info=True)
    finally:
        server.withdraw_token()
        if server.ring is not None:
            server.ring.close()
        io.stop(config.close_timeout)
        if job is not None:
            job.close()

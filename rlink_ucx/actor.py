"""The actor: ``put`` steps; they are coalesced into frames and streamed to the learner."""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Self

import numpy as np

from .config import Config, resolve
from .errors import ConfigError, RLinkWarning
from .errors import TimeoutError as RLinkTimeout
from .session.actor.link import ActorConnection
from .session.actor.writer import StepWriter
from .session.tokens import resolve_token
from .store.replay.table import PRIORITY_FIELD
from .transport import check_transport
from .transport.address import parse_endpoint
from .transport.loop import release_io, shared_io
from .weights.subscriber import Subscriber
from .weights.unwrap import inner_module
from .wire.codec import Schema
from .wire.frameworks import Adapter, adapter_soon, default_format
from .wire.manifest import unflatten
from .wire.messages import Welcome

log = logging.getLogger(__name__)

__all__ = ["Actor"]


class Actor:
    """Streams steps to a :class:`Learner`.

    Args:
        address: the learner's ``host:port`` (``[::1]:8443`` for IPv6; a ``tcp://``, ``ucx://``,
            ``shm://`` or ``rlink://`` prefix names the transport).
        token: shared secret, at least 16 bytes, surrounding whitespace ignored (default
            ``RLINK_TOKEN`` / ``RLINK_TOKEN_FILE``; :func:`rlink_ucx.read_token_file` reads such a file).
            With none, an actor connecting to a loopback address uses the token its learner
            generated (the file only this user can read, see ``Config.token_dir``), read anew
            at each connection attempt; for other addresses a token must be given.
        transport: ``"auto"`` (the learner picks: ``shm`` on its own host, ``ucx`` where UCX has
            RDMA or CUDA transports, ``tcp`` otherwise), or ``"tcp"``, ``"ucx"``, ``"shm"``;
            :attr:`transport` and :attr:`transport_reason` report the choice.
        actor_id: a stable integer id (the learner assigns one when None).
        config: timeouts and caps.
        schema: optional declaration ``{"obs": ("float32", (4,)), ...}``; otherwise inferred
            from the first ``put``.
        subscribe: start receiving published weights now (else at the first
            ``get_remote_model``).
        insecure: accept a learner that does not authenticate (one started with
            ``insecure=True``). Without it such a learner is refused with :class:`AuthError`:
            anyone could be listening on that port.

    The actor may start before its learner: it retries with backoff until
    ``Config.connect_timeout`` (120 s). When the learner finishes, the next call raises
    :class:`Closed`.

    ``put`` copies the step into a frame buffer and returns. A step put while nothing is being
    sent leaves at once, from the calling thread (an actor putting a few steps a second wakes
    no other thread); steps that come faster wait for company and go out in frames, when full
    (``Config.frame_bytes``) or about ``Config.frame_linger`` seconds after their first step.
    Call ``flush()`` to wait until the learner holds everything put so far.

    Example::

        with Actor("127.0.0.1:8443") as actor:
            actor.put({"obs": obs, "action": 1, "reward": 1.0, "done": False})
            actor.flush()

    Raises:
        ConnectError: the learner could not be reached within ``Config.connect_timeout``.
        AuthError: the learner refused the token, could not prove it knows it, or does not
            authenticate at all (without ``insecure=True``); no step is sent to such a learner.
    """

    def __init__(self, address: str, *, token: str | bytes | None = None, transport: str = "auto",
                 actor_id: int | None = None, config: Config | None = None,
                 schema: dict[str, Any] | Schema | None = None, subscribe: bool = False,
                 insecure: bool = False):  # fmt: skip
        self.config = resolve(config)
        check_transport(transport)
        if actor_id is not None and not (isinstance(actor_id, int) and 0 <= actor_id < 1 << 63):
            raise ConfigError(f"actor_id must be an int in [0, 2**63), not {actor_id!r}")
        host, port, transport = parse_endpoint(address, transport)
        self._lock = threading.Lock()  # guards the subscriber's creation
        self._subscriber: Subscriber | None = None
        self._adapters: dict[str, Future[Adapter]] = {}  # get_remote_model's formats, made once
        self._loaded: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # module -> version
        resolved_token = resolve_token(token)  # may raise: before the shared I/O thread is taken
        self._io = shared_io()  # one I/O thread for every Actor of this process
        self._io_released = False
        try:
            self._build(host, port, resolved_token, transport, actor_id, insecure)
        except BaseException:
            self._io_released = True  # nothing else holds it for this actor
            release_io(self._io, self.config.close_timeout)
            raise
        budget = self.config.connect_timeout + 2 * self.config.handshake_timeout + 1
        try:
            self._io.call(self._conn.open_session(), budget, "connect")
            if schema is not None:
                self._writer.negotiate(Schema.from_spec(schema) if isinstance(schema, dict) else schema)
        except BaseException:
            self._shutdown()
            raise
        assert self._conn.welcome is not None
        self._writer.policy_version = self._conn.welcome.version
        if subscribe:
            self._subscribe()
        log.info("actor %s connected to %s via %s (%s)", self.actor_id, address, self.transport, self.transport_reason)

    def _build(self, host: str, port: int, token: bytes | None, transport: str, actor_id: int | None,
               insecure: bool) -> None:  # fmt: skip
        # Increases with every restart of an actor id: the learner lets a newer incarnation
        # replace an older one, never the reverse (the old process would otherwise reconnect
        # and push the new one out, back and forth).
        incarnation = time.time_ns()
        self._conn = ActorConnection(host, port, token=token, transport=transport,
                                     actor_id=actor_id, incarnation=incarnation & (2**63 - 1),
                                     config=self.config, io=self._io, insecure=insecure)  # fmt: skip
        self._writer = StepWriter(self._conn, self._io, self.config)

    @property
    def actor_id(self) -> int:
        """This actor's id: the one given, or the one the learner assigned."""
        return self._welcome("actor_id").actor_id

    @property
    def transport(self) -> str:
        """The data plane the learner chose for this actor: ``"shm"``, ``"tcp"`` or ``"ucx"``."""
        return self._welcome("transport").transport

    @property
    def transport_reason(self) -> str:
        """Why that data plane, e.g. ``"auto: same host, shared-memory ring"``."""
        return self._welcome("transport_reason").reason

    def _welcome(self, what: str) -> Welcome:
        welcome = self._conn.welcome  # the newest session's: a reconnect may change the plane
        if welcome is None:
            raise AttributeError(f"{what}: the actor never connected")
        return welcome

    @property
    def schema(self) -> Schema | None:
        """The negotiated schema (None until the first ``put`` or a declared one)."""
        return self._conn.schema

    @property
    def policy_version(self) -> int:
        """The model version stamped on steps put without an explicit ``version=``."""
        return self._writer.policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._writer.policy_version = int(value)

    # --- putting steps --------------------------------------------------------------------------
    def put(self, step: Mapping[str, Any], *, version: int | None = None, priority: float | None = None) -> None:
        """Append one step (field name -> array or scalar) to the outgoing stream.

        ``priority``: the step's initial priority for a prioritized :class:`ReplayDataset` on
        the learner. It travels as a reserved float32 field ``"_priority"`` of the schema, so an
        actor passes a priority on every put (and put_many) or on none.

        Values are cast to the negotiated dtype, the learner's schema (which another actor's
        first step may have set), wherever the kind is kept: a Python float or list, float64 ->
        float32, Python ints or int64 -> int32 or uint8 while every value fits, int -> float.
        A change of kind (float -> int, to or from bool) or of shape raises ``SchemaMismatch``
        naming the field and both specs. The same rule holds for ``put_many``.

        Raises:
            SchemaMismatch: a field is missing or extra, or its value cannot take the negotiated
                dtype and shape (the message names the field, the expected and the given).
            Backpressure: no credit from the learner within ``Config.put_timeout``.
            PeerLost: the learner was lost for longer than ``Config.reconnect_timeout``.
            Closed: the actor was closed, or the learner finished.
        """
        if priority is not None:
            step = _with_priority(step, np.float32(float(priority)))
        self._writer.put(step, version=version)

    def put_many(self, steps: Mapping[str, Any], *, version: int | None = None, priority: Any = None) -> None:
        """Append a chunk of steps: every field has a leading time/batch dimension of equal
        size (a vectorized env's step, or an unroll). Values convert as in :meth:`put`.
        ``priority``: one per step (an array of the chunk's length) or one for all (a scalar)."""
        if not isinstance(steps, Mapping):
            raise TypeError(f"put_many takes a mapping of field name -> array with a leading time/batch axis "
                            f"({{'obs': obs[n, ...], ...}}), not a {type(steps).__name__}: call put() for each "
                            "step, or stack them: {k: np.stack([s[k] for s in steps]) for k in steps[0]}")
        if priority is not None:
            if hasattr(priority, "detach"):  # a torch tensor, maybe on a GPU
                priority = priority.detach().cpu().numpy()
            p = np.asarray(priority, dtype=np.float32)
            if p.ndim == 0 and steps:
                p = np.full(len(next(iter(steps.values()))), p, dtype=np.float32)
            steps = _with_priority(steps, p)
        self._writer.put_many(steps, version=version)

    def flush(self, timeout: float | None = None) -> None:
        """Send any partial frame and wait until the learner holds every step put so far.
        
        Raises:
            TimeoutError: not acknowledged within ``timeout`` (default ``Config.flush_timeout``).
        """
        self._writer.flush(timeout)

    # --- weights ----------------------------------------------------------------------------------
    def _subscribe(self) -> Subscriber:
        with self._lock:
            if self._subscriber is None:
                self._writer.check_open()
                self._subscriber = Subscriber(self._conn, self._io, self.config)
            return self._subscriber

    def get_remote_model(self, timeout: float | None = None, *, latest: bool = True, format: str | None = None,
                         newer_than: int | None = None) -> tuple[dict[str, Any], int]:  # fmt: skip
        """The newest published parameters and their version; sets :attr:`policy_version`.

        The first call subscribes this actor: from then on a background thread keeps the newest
        version ready, so later calls return at once when nothing changed. The arrays are
        views of a buffer that is never overwritten while you hold them (treat them as
        read-only); a framework that cannot take a view gets a copy (``docs/frameworks.md``).
        The mapping has the nesting the learner published: a flat state dict comes back flat,
        a pytree of dicts (flax params) comes back nested.

        Args:
            timeout: seconds the whole call may take (default ``Config.weights_timeout``),
                importing the format's framework included.
            latest: wait for the newest version the learner had announced when the call began
                (one announced meanwhile is not waited for). When False, return the newest
                version already here without waiting; with none here yet (nothing published,
                or the first version still arriving) that is ``({}, 0)``: an empty mapping and
                version 0, and :attr:`policy_version` is left as it was.
            format: the arrays' framework: ``"torch"``, ``"numpy"``, ``"jax"`` or
                ``"tensorflow"`` (host memory; JAX and TensorFlow on their CPU device). Default:
                torch where torch is installed (what rlink always returned), numpy otherwise.
            newer_than: wait for a version above this one (whatever ``latest`` says): the
                on-policy loop's "the version after the one I acted with", e.g.
                ``get_remote_model(newer_than=actor.policy_version)`` (``docs/on-policy.md``).

        Raises:
            ConfigError: ``format`` names a framework that is not installed (at once).
            TimeoutError: no (or, with ``latest``, not the newest; with ``newer_than``, no
                newer) version within ``timeout``.
            Closed: the learner closed (checked on every call, also while a version is here:
                an actor that only reads weights learns it from this call), or the actor did.
            PeerLost: the learner was lost for longer than ``Config.reconnect_timeout``.
        """
        started = time.monotonic()  # the framework's import below counts in the timeout
        deadline = started + (self.config.weights_timeout if timeout is None else timeout)
        if newer_than is not None:
            try:
                newer_than = operator.index(newer_than)
            except TypeError as exc:
                raise ConfigError(f"newer_than must be an int version or None, not {newer_than!r}") from exc
        subscriber = self._subscribe()
        waits = latest or newer_than is not None
        snap = None if waits else subscriber.get(deadline, latest=False)
        if not waits and snap is None:
            return {}, 0  # nothing here: no framework to import either
        fmt = default_format() if format is None else format
        pending = self._adapter(fmt)  # its import runs while we wait for the version
        if snap is None:
            snap = subscriber.get(deadline, latest, newer_than)
            assert snap is not None  # it waited for one
        try:
            converter = pending.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise RLinkTimeout(f"weights version {snap.version} is here, but importing {fmt} for it took longer than "
                               f"the timeout ({deadline - started:.3g}s); it goes on: call again") from None  # fmt: skip
        self._writer.policy_version = snap.version
        return unflatten(subscriber.arrays(snap, converter)), snap.version

    def _adapter(self, fmt: str) -> Future[Adapter]:
        """The adapter of ``fmt``, made once per actor (on a helper thread: ``adapter_soon``)."""
        with self._lock:
            pending = self._adapters.get(fmt)
            if pending is None:
                pending = self._adapters[fmt] = adapter_soon(fmt)
            return pending

    def load_remote_model(self, module: Any, timeout: float | None = None, *, latest: bool = True,
                          newer_than: int | None = None) -> int:  # fmt: skip
        """Copy the newest published parameters into ``module`` in place; returns the version.
        A module that already holds that version (loaded by this call before) is left as it is,
        so calling this every step costs a lookup while nothing new was published. A
        ``DistributedDataParallel`` or ``torch.compile``d ``module`` loads into the module it wraps. ``timeout``,
        ``latest`` and ``newer_than`` as in :meth:`get_remote_model`; with ``latest=False`` and
        no version here yet, the module is left as it is and 0 returned.

        Example (on-policy: one rollout per version)::

            version = actor.load_remote_model(policy)
            while True:
                actor.put(rollout(policy), version=version)
                version = actor.load_remote_model(policy, newer_than=version)

        Raises:
            as :meth:`get_remote_model`.
        """
        started = time.monotonic()
        import torch  # counted in the timeout, as get_remote_model counts its own import

        if timeout is None:
            timeout = self.config.weights_timeout
        left = max(0.0, timeout - (time.monotonic() - started))
        state, version = self.get_remote_model(left, latest=latest, format="torch", newer_than=newer_than)
        module = inner_module(module)
        if version == 0 or self._loaded.get(module) == version:
            return version
        with torch.no_grad():
            module.load_state_dict(state)
        self._loaded[module] = version
        return version

    def stats(self) -> dict[str, Any]:
        """Counters: steps put and sent, frames, bytes, credit waits, acknowledgements; the learner
        (rank, in a job of many learners) serving this actor."""
        return {
            "actor_id": self.actor_id,
            "transport": self.transport,
            "transport_reason": self.transport_reason,
            "steps_put": self._writer.steps_put,
            **self._conn.stats(),
            "policy_version": self._writer.policy_version,
            "weights": dict(self._subscriber.stats, version=self._subscriber.have) if self._subscriber else None,
        }

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Flush what was put (bounded by ``timeout``), say goodbye and disconnect. Idempotent."""
        if self._writer.closed:
            return
        try:
            if self._conn.error is None and self._writer.has_schema:
                self.flush(self.config.close_timeout if timeout is None else timeout)
        except Exception as exc:  # noqa: BLE001 - closing must finish; the loss is reported
            self._warn_unflushed(exc)
        finally:
            self._shutdown()

    def _warn_unflushed(self, exc: Exception) -> None:
        """Steps the learner may never get are a warning users see without asking for logs
        (on stderr by default; an :class:`RLinkWarning` they can filter)."""
        unacked = max(0, self._writer.steps_put - self._conn.stats()["steps_acked"])
        warnings.warn(
            f"actor {getattr(self, 'actor_id', '?')} closed with {unacked} of {self._writer.steps_put} steps "
            f"not acknowledged by the learner (they may be lost): {type(exc).__name__}: {exc}",
            RLinkWarning,
            stacklevel=3,
        )

    def _shutdown(self) -> None:
        self._writer.shutdown(self._disconnect)
        if not self._io_released:  # the shared loop stops with its last actor
            self._io_released = True
            release_io(self._io, self.config.close_timeout)
        self._conn.release()

    def _disconnect(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
        try:
            self._io.call(self._conn.close(), self.config.close_timeout, "actor close")
        except Exception:  # release resources even if the graceful path fails
            log.debug("graceful actor shutdown failed", exc_info=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Actor(actor_id={getattr(self, 'actor_id', None)}, transport={getattr(self, 'transport', None)!r})"


def _with_priority(step: Mapping[str, Any], priority: Any) -> dict[str, Any]:
    """The step with its priority in the reserved field (read and removed by the replay)."""
    if PRIORITY_FIELD in step:
        raise ConfigError(f"field name {PRIORITY_FIELD!r} is reserved for priority=")
    return {**step, PRIORITY_FIELD: priority}

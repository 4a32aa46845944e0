"""The actor: ``put`` steps, they are coalesced into frames and streamed to the learner."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .config import Config, resolve, resolve_token
from .errors import Backpressure, Closed, PeerLost, ProtocolError, SchemaMismatch
from .errors import TimeoutError as RLinkTimeout
from .session.actor_link import ActorConnection, BorrowedFrame, FrameBuffer
from .transport import check_transport
from .transport.address import parse_address
from .transport.loop import IOThread
from .weights.subscriber import Subscriber
from .wire.codec import DTYPES, Schema, as_host_array, infer_schema

log = logging.getLogger(__name__)

__all__ = ["Actor"]

_SCALAR_KINDS = {bool: "b", int: "iu", float: "f"}


class _Field:
    """What ``put`` checks a value against, precomputed once per schema."""

    __slots__ = ("name", "spec", "dtype", "shape", "index", "scalars")

    def __init__(self, index: int, spec: Any):
        self.index = index
        self.name = spec.name
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        self.shape = spec.shape
        # Scalar types a 0-d field takes as they are: Python's (bool for a bool field, ...) and
        # the numpy scalar of its exact dtype (np.float32 for a float32 field), which policies
        # and environments often return; any other goes through the converting path.
        python = [t for t, kinds in _SCALAR_KINDS.items() if self.dtype.kind in kinds]
        self.scalars = frozenset([*python, self.dtype.type] if not self.shape else [])

    def mismatch(self, value: Any, got: str) -> SchemaMismatch:
        return SchemaMismatch(f"field {self.name!r}: the negotiated schema says {self.spec.describe()}, got {got}")


class Actor:
    """Streams steps to a :class:`Learner`.

    Args:
        address: the learner's ``host:port``.
        token: shared secret (default ``RLINK_TOKEN`` / ``RLINK_TOKEN_FILE``).
        transport: ``"auto"``, ``"tcp"`` or ``"ucx"``; the learner reports the choice.
        actor_id: a stable integer id (the learner assigns one when None).
        config: timeouts and caps.
        schema: optional declaration ``{"obs": ("float32", (4,)), ...}``; otherwise inferred
            from the first ``put``.

    ``put`` copies the step into a frame buffer and returns; frames go out in the background
    when full (``Config.frame_bytes``) or ``Config.frame_linger`` seconds after their first
    step. Call ``flush()`` to wait until the learner holds everything put so far.

    Example::

        with Actor("127.0.0.1:8443") as actor:
            actor.put({"obs": obs, "action": 1, "reward": 1.0, "done": False})
            actor.flush()

    Raises:
        ConnectError / AuthError: the learner is unreachable or refused the token.
    """

    def __init__(self, address: str, *, token: str | bytes | None = None, transport: str = "auto",
                 actor_id: int | None = None, config: Config | None = None,
                 schema: dict[str, Any] | Schema | None = None, subscribe: bool = False):  # fmt: skip
        self.config = resolve(config)
        host, port = parse_address(address)
        check_transport(transport)
        self._closed = False
        self._lock = threading.Lock()
        self._current: FrameBuffer | None = None
        self._next_seq = 0
        self._fields: list[_Field] | None = None
        # (name, dtype, shape, scalar types) per field for put's one-pass fast path; None when a
        # field needs conversion (bfloat16) or before the schema is known.
        self._fast: tuple[tuple[str, np.dtype, tuple, frozenset], ...] | None = None
        self._policy_version = 0
        self._frame_steps = 0  # steps per frame, known once the schema is negotiated
        self._max_buffers = self.config.frame_buffers  # frame buffers allowed (resending keeps more)
        # Large puts go out zero-copy from the caller's memory unless they must be kept for resending.
        self._copy_large = self.config.resend_buffer_bytes > 0 and self.config.resend_large_puts
        self._subscriber: Subscriber | None = None
        self._io = IOThread(name="rlink-actor-io")
        # Increases with every restart of an actor id: the learner lets a newer incarnation
        # replace an older one, never the reverse (the old process would otherwise reconnect
        # and push the new one out, back and forth).
        incarnation = time.time_ns()
        self._conn = ActorConnection(host, port, token=resolve_token(token), transport=transport,
                                     actor_id=actor_id, incarnation=incarnation & (2**63 - 1),
                                     config=self.config, loop=self._io.loop)  # fmt: skip
        budget = self.config.connect_timeout + self.config.handshake_timeout + 1
        try:
            self._io.call(self._conn.connect(), budget, "connect")
            if schema is not None:
                self._negotiate(Schema.from_spec(schema) if isinstance(schema, dict) else schema)
        except BaseException:
            self._shutdown()
            raise
        assert self._conn.welcome is not None
        self.actor_id: int = self._conn.welcome.actor_id
        self.transport: str = self._conn.welcome.transport
        self.transport_reason: str = self._conn.welcome.reason
        self._policy_version = self._conn.welcome.version
        self._io.soon(self._linger_tick)
        if subscribe:
            self._subscribe()
        log.info("actor %s connected to %s via %s (%s)", self.actor_id, address, self.transport, self.transport_reason)

    # --- schema -----------------------------------------------------------------------------------
    @property
    def schema(self) -> Schema | None:
        return self._conn.schema

    def _negotiate(self, schema: Schema) -> None:
        reply = self._io.call(self._conn.propose(schema), self.config.handshake_timeout, "schema negotiation")
        from .wire.messages import Reject

        if isinstance(reply, Reject):
            raise SchemaMismatch(f"learner rejected the schema: {reply.reason}")
        capacity = max(1, min(reply.max_steps, self.config.frame_bytes // max(schema.step_bytes, 1)))
        self._conn.schema, self._conn.schema_id = schema, reply.schema_id
        self._conn.max_frame_steps = reply.max_steps  # no wire frame may carry more
        self._conn.free = [self._new_frame_buffer(schema, capacity) for _ in range(self.config.frame_buffers)]
        self._conn.buffers = self.config.frame_buffers
        self._max_buffers = max(self.config.frame_buffers,
                                self.config.resend_buffer_bytes // max(1, capacity * schema.step_bytes))  # fmt: skip
        self._fields = [_Field(i, spec) for i, spec in enumerate(schema.fields)]
        if all(f.spec.dtype != "bfloat16" for f in self._fields):
            self._fast = tuple((f.name, f.dtype, f.shape, f.scalars) for f in self._fields)
        self._frame_steps = capacity

    def _ensure_schema(self, step: Mapping[str, Any], leading_dims: int) -> list[_Field]:
        if self._fields is None:
            self._check_open()
            self._negotiate(infer_schema(step, leading_dims=leading_dims))
        assert self._fields is not None
        return self._fields

    # --- putting steps --------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The model version stamped on steps put without an explicit ``version=``."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._policy_version = int(value)

    def put(self, step: Mapping[str, Any], *, version: int | None = None) -> None:
        """Append one step (field name -> array or scalar) to the outgoing stream.

        Raises:
            SchemaMismatch: a field is missing, extra, or has another dtype/shape than negotiated.
            Backpressure: no credit from the learner within ``Config.put_timeout``.
            PeerLost / Closed: the connection broke / the actor was closed.
        """
        fast = self._fast
        if fast is not None and len(step) == len(fast) and self._put_in_frame(step, version, checked=False):
            return  # almost every call: exact dtypes and shapes, room in the current frame
        fields = self._fields or self._ensure_schema(step, 0)
        values = [self._check_value(f, step) for f in fields]
        if len(step) != len(fields):
            self._raise_extra(step, fields)
        if self._frame_steps == 1 and not self._copy_large and all(
            type(v) is np.ndarray and v.flags.c_contiguous for v in values
        ):
            self._send_borrowed([v.reshape(1, *v.shape) for v in values], 1, version)
            return
        if not self._put_in_frame(values, version, checked=True):
            self._append(1, version, lambda fb, at, src, k: _write_step(fb, at, values))

    def _put_in_frame(self, step: Any, version: int | None, checked: bool) -> bool:
        """Write one step into the current frame if it has room (else False: nothing written).

        ``checked``: ``step`` is the list of values already checked and converted. Otherwise it
        is the caller's mapping, checked field by field while it is copied (one pass): any
        value that is not exactly the negotiated dtype and shape returns False for the general
        path, which converts it or raises a clear error. A step abandoned halfway leaves bytes
        past the frame's end, which are never sent.
        """
        v = self._policy_version if version is None else int(version)
        with self._lock:
            fb = self._current
            if (fb is None or fb.n >= fb.capacity - 1 or (fb.version != v and fb.n)
                    or self._closed or self._conn.error is not None):  # fmt: skip
                return False
            at = fb.n
            if checked:
                for arr, value in zip(fb.typed, step):
                    arr[at] = value
            else:
                assert self._fast is not None
                for (name, dtype, shape, scalars), arr in zip(self._fast, fb.typed):
                    value = step.get(name)
                    kind = type(value)
                    if kind is np.ndarray:
                        if value.shape != shape or (value.dtype is not dtype and value.dtype != dtype):
                            return False
                    elif kind not in scalars:
                        return False
                    arr[at] = value
            fb.version = v
            fb.n = at + 1
            self._next_seq += 1
            return True

    def put_many(self, steps: Mapping[str, Any], *, version: int | None = None) -> None:
        """Append a chunk of steps: every field has a leading time/batch dimension of equal size."""
        fields = self._fields or self._ensure_schema(steps, 1)
        if len(steps) != len(fields):
            self._raise_extra(steps, fields)
        arrays = []
        count = -1
        for f in fields:
            if f.name not in steps:
                raise SchemaMismatch(f"field {f.name!r} ({f.spec.describe()}) is missing from the chunk")
            arr, dtype = as_host_array(steps[f.name])
            if dtype != f.spec.dtype or arr.shape[1:] != f.shape or arr.ndim != len(f.shape) + 1:
                got = f"{dtype}{list(arr.shape[1:])} per step (chunk shape {list(arr.shape)})"
                raise f.mismatch(arr, got if arr.ndim else f"{dtype}[] (a chunk needs a leading time axis)")
            if count not in (-1, arr.shape[0]):
                raise SchemaMismatch(f"field {f.name!r} has {arr.shape[0]} steps, others have {count}")
            count = arr.shape[0]
            arrays.append(arr)
        if count == 0:
            return
        if count >= self._frame_steps and not self._copy_large and all(a.flags.c_contiguous for a in arrays):
            self._send_borrowed(arrays, count, version)
            return
        self._append(count, version, lambda fb, at, src, k: _write_chunk(fb, at, arrays, src, k))

    def _send_borrowed(self, arrays: list[np.ndarray], count: int, version: int | None) -> None:
        """At least a full frame: send from the caller's memory instead of copying it (like
        ``sendall``, return once the transport has taken the bytes)."""
        v = self._policy_version if version is None else int(version)
        self._check_open()
        conn = self._conn
        deadline = time.monotonic() + self.config.put_timeout
        with self._lock:
            self._submit_locked()  # an earlier partial frame goes first
            frame = BorrowedFrame(arrays, count, self._next_seq, v)
            self._next_seq += count
            with conn.changed:
                direct = conn.outstanding == 0 and self._direct()
        try:
            if direct:  # nothing queued: send on this thread, no hand-off to the I/O thread
                try:
                    conn.send_direct(frame, deadline)
                    return
                except (PeerLost, ProtocolError):
                    # The connection broke mid-put. The caller's arrays stay ours until we
                    # return, so the frame goes to the I/O thread, which resends it from where
                    # the learner stopped once it has reconnected (or fails it for good).
                    if conn.error is not None or self.config.reconnect_timeout <= 0:
                        raise
            frame.done = done = threading.Event()
            self._hand_off(frame)
            if not done.wait(self.config.put_timeout):
                frame.cancelled = True
                done.wait(self.config.frame_timeout + self.config.close_timeout)
                raise Backpressure(f"no credit from the learner for {self.config.put_timeout:.3g}s; "
                                   f"{frame.sent} of {count} steps were sent")  # fmt: skip
            self._check_open()
        except Backpressure:
            with self._lock:
                self._next_seq = frame.seq + frame.sent  # unsent steps were never put
                conn.next_send_seq = self._next_seq
            raise

    def _check_value(self, f: _Field, step: Mapping[str, Any]) -> Any:
        try:
            v = step[f.name]
        except KeyError:
            raise SchemaMismatch(f"field {f.name!r} ({f.spec.describe()}) is missing from the step") from None
        kind = type(v)
        if kind is np.ndarray:
            if v.dtype == f.dtype and v.shape == f.shape and f.spec.dtype != "bfloat16":
                return v
        elif kind in _SCALAR_KINDS and not f.shape:
            if f.dtype.kind in _SCALAR_KINDS[kind] and f.spec.dtype != "bfloat16":
                return v
            raise f.mismatch(v, f"a Python {kind.__name__}")
        arr, dtype = as_host_array(v)
        if dtype != f.spec.dtype or arr.shape != f.shape:
            raise f.mismatch(v, f"{dtype}{list(arr.shape)}")
        return arr

    @staticmethod
    def _raise_extra(step: Mapping[str, Any], fields: list[_Field]) -> None:
        known = {f.name for f in fields}
        extra = [k for k in step if k not in known]
        missing = [f.name for f in fields if f.name not in step]
        raise SchemaMismatch(f"step fields differ from the schema: extra {extra}, missing {missing}")

    def _append(self, count: int, version: int | None, write: Any) -> None:
        v = self._policy_version if version is None else int(version)
        conn = self._conn
        deadline = time.monotonic() + self.config.put_timeout
        done = 0
        while done < count:
            if conn.error is not None or self._closed:
                self._check_open()
            full = None
            with self._lock:
                fb = self._current
                if fb is not None and fb.n and fb.version != v:  # one version per frame
                    self._submit_locked()
                    fb = None
                if fb is not None:
                    k = min(count - done, fb.capacity - fb.n)
                    write(fb, fb.n, done, k)
                    fb.n += k
                    self._next_seq += k
                    done += k
                    if fb.n == fb.capacity:
                        full, self._current = fb, None
            if full is not None:
                self._dispatch(full, v)
                continue
            if fb is not None:
                continue
            fresh = self._acquire(deadline)
            with self._lock:
                if self._current is None:
                    fresh.reset(self._next_seq, v)
                    self._current = fresh
                else:
                    conn.give_back(fresh)

    def _dispatch(self, fb: FrameBuffer, version: int) -> None:
        """Send a full frame. With nothing queued and credit at hand, send it on this thread
        (and reuse the cache-warm buffer unless it must be kept for resending); otherwise hand
        it to the I/O thread."""
        conn = self._conn
        with conn.changed:
            idle = conn.outstanding == 0 and self._direct()
        if idle and conn.take_all_credit(fb.n):
            with conn.send_lock:
                if conn.resend:  # kept until acknowledged; if the send fails, resent after reconnecting
                    with conn.changed:
                        conn.inflight.append(fb)
                conn.send_part_or_fail(fb, fb.n)
            if conn.resend:
                return
            with self._lock:
                if self._current is None:
                    fb.reset(self._next_seq, version)
                    self._current = fb
                    return
            conn.give_back(fb)
            return
        with self._lock:
            self._hand_off(fb)

    def _acquire(self, deadline: float) -> FrameBuffer:
        conn = self._conn
        with conn.changed:
            while not conn.free:
                # Frames kept for resending do not count against the frame_buffers that may be
                # filled ahead of the network (or put would run ahead of its credit).
                if conn.buffers < self._max_buffers and conn.buffers - len(conn.inflight) < self.config.frame_buffers:
                    conn.buffers += 1
                    return self._new_frame_buffer(self._conn.schema, self._frame_steps)
                if conn.inflight:  # every buffer waits for an acknowledgement: ask for one now
                    self._io.soon(conn.sync, conn.inflight[-1].seq + conn.inflight[-1].sent)
                self._check_open()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Backpressure(
                        f"no credit from the learner for {self.config.put_timeout:.3g}s "
                        f"({len(conn.queue)} frames waiting); the learner is not consuming fast enough"
                    )
                conn.changed.wait(min(left, 0.5))
            return conn.free.pop()

    def _new_frame_buffer(self, schema: Schema, capacity: int) -> FrameBuffer:
        return FrameBuffer(schema, capacity, self._conn.frame_memory(capacity * schema.step_bytes))

    def _direct(self) -> bool:
        """May the caller's thread send itself? Only on a transport that allows any thread (tcp);
        asked per send, because a reconnect may land on another transport."""
        return bool(getattr(self._conn.sender, "any_thread", False))

    def _submit_locked(self) -> None:
        fb, self._current = self._current, None
        if fb is None:
            return
        if fb.n:
            self._hand_off(fb)
        else:  # an empty (reused) buffer goes back to the pool, or it would be lost for good
            self._conn.give_back(fb)

    def _hand_off(self, frame: FrameBuffer | BorrowedFrame) -> None:
        with self._conn.changed:
            self._conn.outstanding += 1
        self._io.soon(self._conn.submit, frame)

    def _linger_tick(self) -> None:
        """On the I/O loop, every ``frame_linger``: send a partial frame that waited long enough."""
        fb = self._current  # unlocked peek: most ticks find nothing to do
        if fb is not None and fb.n and time.monotonic() - fb.started >= self.config.frame_linger:
            with self._lock:
                if self._current is fb and fb.n:
                    self._current = None
                    # Through the loop's ready queue, like every other hand-off: an earlier full
                    # frame handed off by the caller's thread may still be waiting there, and
                    # frames must reach the wire in seq order.
                    self._hand_off(fb)
        if not self._closed:
            self._io.loop.call_later(self.config.frame_linger, self._linger_tick)

    def flush(self, timeout: float | None = None) -> None:
        """Send any partial frame and wait until the learner holds every step put so far.

        Raises:
            TimeoutError: not acknowledged within ``timeout`` (default ``Config.flush_timeout``).
        """
        self._check_open()
        with self._lock:
            self._submit_locked()
            target = self._next_seq
        limit = self.config.flush_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        conn = self._conn
        self._io.soon(conn.sync, target)
        with conn.changed:
            while conn.acked < target:
                self._check_open()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RLinkTimeout(f"flush: learner acknowledged {conn.acked} of {target} steps within {limit:.3g}s")
                if not conn.changed.wait(min(left, 0.5)):
                    self._io.soon(conn.sync, target)  # again: the first may have gone to a learner that died

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("the actor is closed")
        err = self._conn.error
        if err is not None:
            raise type(err)(str(err)) from err

    # --- weights ----------------------------------------------------------------------------------
    def _subscribe(self) -> Subscriber:
        with self._lock:
            if self._subscriber is None:
                self._check_open()
                self._subscriber = Subscriber(self._conn, self._io, self.config)
            return self._subscriber

    def get_remote_model(self, timeout: float | None = None, *, latest: bool = True) -> tuple[dict[str, Any], int]:
        """The newest published parameters and their version; sets :attr:`policy_version`.

        The first call subscribes this actor: from then on a background thread keeps the newest
        version ready, so later calls return at once when nothing changed. The tensors are
        read-only views of a buffer that is never overwritten while you hold them.

        Args:
            timeout: seconds to wait (default ``Config.weights_timeout``).
            latest: when False, return the newest version already here without waiting for a
                newer one in flight (still waits if there is none yet).

        Raises:
            TimeoutError: no (or, with ``latest``, not the newest) version within ``timeout``.
        """
        state, version = self._subscribe().get(timeout, latest)
        self._policy_version = version
        return state, version

    def load_remote_model(self, module: Any, timeout: float | None = None, *, latest: bool = True) -> int:
        """Copy the newest published parameters into ``module`` in place; returns the version."""
        import torch

        state, version = self.get_remote_model(timeout, latest=latest)
        with torch.no_grad():
            module.load_state_dict(state)
        return version

    def stats(self) -> dict[str, Any]:
        """Counters: steps put and sent, frames, bytes, credit waits, acknowledgements."""
        c = self._conn
        return {
            "actor_id": self.actor_id,
            "transport": self.transport,
            "transport_reason": self.transport_reason,
            "steps_put": self._next_seq,
            "steps_sent": c.sent_steps,
            "steps_acked": c.acked,
            "frames_sent": c.sent_frames,
            "bytes_sent": c.sent_bytes,
            "credit": c.credit,
            "credit_waits": c.credit_waits,
            "reconnects": c.reconnects,
            "steps_lost": c.steps_lost,
            "connected": c.connected,
            "error": repr(c.error) if c.error else None,
            "policy_version": self._policy_version,
            "weights": dict(self._subscriber.stats, version=self._subscriber.have) if self._subscriber else None,
        }

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Flush what was put (bounded by ``timeout``), say goodbye and disconnect. Idempotent."""
        if self._closed:
            return
        try:
            if self._conn.error is None and self._fields is not None:
                self.flush(self.config.close_timeout if timeout is None else timeout)
        except Exception as exc:  # noqa: BLE001 - closing must finish; the loss is logged
            log.warning("actor %s closed with unflushed steps: %s", getattr(self, "actor_id", "?"), exc)
        finally:
            self._closed = True
            self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        if self._subscriber is not None:
            self._subscriber.close()
        try:
            self._io.call(self._conn.close(), self.config.close_timeout, "actor close")
        except Exception:  # noqa: BLE001 - release resources even if the graceful path fails
            log.debug("graceful actor shutdown failed", exc_info=True)
        self._io.stop(self.config.close_timeout)
        with self._conn.changed:
            self._conn.changed.notify_all()
        with self._lock:
            self._current = None
        self._conn.release_arena()

    def __enter__(self) -> Actor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Actor(actor_id={getattr(self, 'actor_id', None)}, transport={getattr(self, 'transport', None)!r})"


def _write_step(fb: FrameBuffer, at: int, values: list[Any]) -> None:
    for arr, value in zip(fb.typed, values):
        arr[at] = value


def _write_chunk(fb: FrameBuffer, at: int, arrays: list[np.ndarray], src: int, k: int) -> None:
    for arr, value in zip(fb.typed, arrays):
        arr[at : at + k] = value[src : src + k]

"""The ``ucx`` plane behind the plane interface (``transport/plane.py``): the learner's worker is
in ``learner.py``, the actor's in ``actor.py``. Both are imported only once the plane is used:
importing ucxx loads UCX, mutates environment variables and probes the GPU driver.

The learner starts its worker when the first actor that needs it connects (or at start, when
asked for by name), off the event loop. The actor attaches at the Welcome, which carries the
worker's address over the authenticated control channel: there is no data connection. Where UCX
does not start (its configuration, which no retry cures) the process stops offering the plane.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from typing import TYPE_CHECKING

from ...errors import ConfigError, ConnectError, PeerLost, Rejected
from ...wire import messages as _wire
from ..plane import ActorSide, Attached, LearnerContext, Opening, Plane, SessionSide, Situation
from . import probe as ucx_probe
from .setup import UCX_INSTALL

if TYPE_CHECKING:
    from ..base import FrameReceiver
    from ..control import ControlConnection
    from .generation import Generation
    from .learner import UcxLearnerPlane
    from .setup import UcxUnavailable

log = logging.getLogger(__name__)

_ucx_broken: str | None = None  # why UCX did not start in this process, once it did not


def ucx_available() -> bool:
    """Whether this process can offer the ucx plane: ucxx can be imported (checked without
    importing it) and UCX has not already failed to start here."""
    return _ucx_broken is None and importlib.util.find_spec("ucxx") is not None


def ucx_failure() -> str | None:
    """Why UCX did not start in this process, if it did not (see :func:`ucx_failed`)."""
    return _ucx_broken


def ucx_failed(why: str) -> None:
    """UCX did not start in this process: stop offering it (a configuration error, which no
    retry cures, so for the rest of the process)."""
    global _ucx_broken
    _ucx_broken = why


class UcxPlane(Plane):
    """ucxx endpoints from worker addresses exchanged over the control channel."""

    name = "ucx"
    preference = 0
    data_connection = False
    whole_fields = True  # UCX receives each field as one message into one buffer

    @classmethod
    def available(cls) -> bool:
        return ucx_available()

    @classmethod
    def offered(cls, wanted: str) -> bool:
        return ucx_available() and wanted != "tcp"

    @classmethod
    def unusable(cls) -> str | None:
        if ucx_available():  # else it would start, then refuse every actor
            return None
        why = ucx_failure()
        return (f"transport='ucx', but UCX already failed to start in this process: {why}" if why else
                f"transport='ucx', but ucxx is not installed: {UCX_INSTALL} (or use transport='auto')")  # fmt: skip

    @classmethod
    def refusal(cls, s: Situation) -> str | None:
        if cls.name in s.both:
            return None
        side = "learner" if cls.name not in s.learner else "actor"
        return (f"ucx requested but the {side} offers none (ucxx is not installed there: {UCX_INSTALL}; "
                "or UCX did not start there: see its log)")  # fmt: skip

    @classmethod
    def auto(cls, s: Situation) -> tuple[bool, str]:
        # Over plain TCP (no RDMA, no shared memory, no CUDA) UCX is slower than a raw socket
        # on the machines we measured (docs/benchmarks.md), so auto only picks it where it can
        # use a faster path than TCP; on one host, where a shared ring is faster still, only
        # for CUDA transports (device to device).
        if cls.name not in s.both:
            return False, "auto: ucxx is not installed on both sides"
        fast = ucx_probe.fast_transports()
        if s.same_host and "shm" in s.both:
            cuda = fast & ucx_probe.CUDA
            return (True, f"auto: same host, UCX offers {', '.join(sorted(cuda))}") if cuda else (False, "")
        if fast:
            return True, f"auto: UCX offers {', '.join(sorted(fast))}"
        return False, "auto: UCX has only TCP here and the tcp plane is faster over plain TCP"

    @classmethod
    def explain(cls, picked: str, reason: str) -> str:
        failure = ucx_failure()
        if failure is not None and picked in ("", "tcp") and cls.name in reason:
            # What the choice says of a learner without ucx ("not installed") is not why here.
            return f"{'auto' if picked else 'ucx requested'}: the learner's ucx is off ({failure})"
        return reason

    # --- the actor's side ----------------------------------------------------------------------
    @classmethod
    async def connect(cls, side: ActorSide) -> Attached:
        from .actor import UcxActorPlane
        from .setup import UcxUnavailable

        try:
            sender = await UcxActorPlane.connect(side.loop, side.welcome, side.session_key, side.incarnation,
                                                 side.config, loopback=side.loopback, control=side.control)  # fmt: skip
        except UcxUnavailable as exc:
            ucx_failed(str(exc))  # from now on this process offers the other planes only
            why = f"the learner chose the ucx data plane, but on this actor {exc}"
            if side.wanted == cls.name:
                raise Rejected(why) from exc
            log.error("%s; reconnecting without ucx", why)
            raise ConnectError(why) from exc  # retried: the next Hello offers no ucx
        return Attached(sender, side.welcome)

    # --- the learner's side --------------------------------------------------------------------
    def __init__(self, context: LearnerContext):
        super().__init__(context)
        self.worker: UcxLearnerPlane | None = None  # created when the first actor needs it
        self._starting: asyncio.Future[UcxLearnerPlane] | None = None
        if self.is_offered:
            # Load ucxx now, before any session runs: loading its libraries holds the GIL long
            # enough to stall every session's heartbeats and credits if the first ucx actor
            # set it off.
            from .setup import load_ucxx

            load_ucxx()

    async def start(self) -> None:
        if not self.is_offered:
            return
        from .setup import UcxUnavailable

        try:
            await self._start_worker()
        except (UcxUnavailable, PeerLost) as exc:
            raise ConfigError(f"transport='ucx', but {exc}") from exc

    async def prepare(self) -> None:
        if self.worker is not None:
            return
        from .setup import UcxUnavailable

        try:
            await self._start_worker()
        except UcxUnavailable as exc:  # this actor falls back to another plane, or is refused
            self._unavailable(exc)

    async def _start_worker(self) -> None:
        """Start the worker off the event loop: it takes a good part of a second to come up, and
        the heartbeats and credits of running sessions must not wait for it."""
        if self._starting is None:
            from .learner import UcxLearnerPlane

            c = self.context  # UCX listens where the control channel does (c.host)
            self._starting = c.loop.run_in_executor(None, UcxLearnerPlane, c.loop, c.config, c.loopback, c.host)
        starting = self._starting
        try:
            self.worker = await asyncio.shield(starting)  # a cancelled handshake leaves it starting
        except asyncio.CancelledError:
            raise
        except Exception:
            if self._starting is starting:
                self._starting = None  # the next ucx actor tries again
            raise

    def _unavailable(self, exc: UcxUnavailable) -> None:
        """UCX does not start in this process (its configuration, not the load): stop offering
        it, say so once, and serve actors on the other planes."""
        if not self.is_offered:  # another handshake waiting on the same start said it already
            return
        ucx_failed(str(exc))
        self.is_offered = False
        log.error("the ucx data plane is off for this learner: %s", exc)

    def open(self, reason: str) -> Opening:
        assert self.worker is not None
        return UcxOpening(UcxPlane, reason, learner=self.worker, generation=self.worker.current)

    async def close(self) -> None:
        if self._starting is not None and self.worker is None:
            try:  # a worker still starting is closed once it is up, or its thread would linger
                self.worker = await self._starting
            except Exception:  # it failed to start: nothing to close
                log.debug("the UCX worker failed to start", exc_info=True)
        if self.worker is not None:
            await self.worker.close()

    def counters(self) -> dict[str, int]:
        return {"ucx_workers_recycled": self.worker.recycled if self.worker is not None else 0}


class UcxOpening(Opening):
    """A ucx session: the worker whose address its Welcome carries (read once when the
    session opens: the worker may be recycled meanwhile)."""

    def __init__(self, plane: type[Plane], reason: str, *, learner: UcxLearnerPlane, generation: Generation):
        super().__init__(plane, reason, answer=generation.address)  # the worker's address is the answer
        self.learner, self.generation = learner, generation

    def attach(self, session: SessionSide, conn: ControlConnection | None,
               msg: _wire.Attach | None) -> tuple[FrameReceiver, _wire.Ready]:  # fmt: skip
        receiver = self.learner.attach(session, session.actor_id, session.key, self.generation)
        return receiver, _wire.Ready(UcxPlane.name)

"""Actor side, the data plane's attach: the one the learner chose (tcp, the shm ring and arena,
or ucx) opened after the Welcome, checked when the learner's Ready comes, and the memory the
frame buffers live in."""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ..._memory import Reserve
from ...errors import AuthError, ConnectError, PeerLost
from ...transport import cma, shm, ucx_failed
from ...transport.address import is_loopback
from ...transport.control import ControlConnection
from ...transport.tcp import TcpSender
from ...wire import auth as _auth
from ...wire import keys as _keys
from ...wire import messages as _wire
from .state import LinkState, Rejected

log = logging.getLogger(__name__)

__all__ = ["PlaneAttach", "cuda_visible"]

OpenChannel = Callable[[], Awaitable[tuple[ControlConnection, _wire.Challenge]]]


class PlaneAttach:
    """Attaches the session's data plane (sets ``state.sender``) and owns the frame buffers'
    memory: the shm arena and the populated reserve.

    Args:
        state: the connection's shared state.
        open_channel: opens a connection to the learner and reads its Challenge (the data
            connection of the tcp and shm planes starts like the control channel).
    """

    def __init__(self, state: LinkState, open_channel: OpenChannel):
        self._state = state
        self._open = open_channel
        self.arena: shm.Arena | None = None  # shm plane: frame buffers the learner can read directly
        self._frame_reserve: Reserve | None = None  # the other planes: frame buffers in populated memory
        self._probe: cma.Probe | None = None  # shm: lets the learner prove it may read our memory
        self._attach_proof: bytes | None = None  # the learner's AttachProof, checked when Ready comes

    async def attach(self, welcome: _wire.Welcome) -> None:
        """Attach the plane the Welcome names (the learner's Ready follows on the control channel)."""
        conn = self._state.control
        assert conn is not None
        if welcome.transport in ("tcp", "shm"):
            await self._attach_tcp(welcome)
        else:
            from ...transport.ucx_actor import UcxActorPlane
            from ...transport.ucx_setup import UcxUnavailable

            try:
                self._state.sender = await UcxActorPlane.connect(self._state.loop, welcome, self._state.weights_key(),
                                                                 self._state.incarnation, self._state.config,
                                                                 loopback=is_loopback(self._state.host),
                                                                 control=conn.sock)  # fmt: skip
            except UcxUnavailable as exc:
                ucx_failed(str(exc))  # from now on this process offers the other planes only
                why = f"the learner chose the ucx data plane, but on this actor {exc}"
                if self._state.transport_wanted == "ucx":
                    raise Rejected(why) from exc
                log.error("%s; reconnecting without ucx", why)
                raise ConnectError(why) from exc  # retried: the next Hello offers no ucx

    async def _attach_tcp(self, welcome: _wire.Welcome) -> None:
        """Open the data connection: the tcp plane, or the doorbell of the shm plane."""
        ring = self._map_shm_ring(welcome) if welcome.transport == "shm" else None
        if ring is not None and self.arena is None and self._state.resend:
            self.arena = self._new_arena()
        arena = self.arena.describe() if ring is not None and self.arena is not None else None
        if ring is not None and self._probe is None and self._state.config.shm_direct_read and cma.available():
            self._probe = cma.Probe()  # lives as long as the connection: the learner reads it at each attach
        probe = self._probe.describe() if ring is not None and self._probe is not None else None
        data, challenge = await self._open_data_connection()
        data.send(_wire.Attach(_wire.PROTOCOL_VERSION, welcome.session,
                               _auth.data_proof(self._state.weights_key(), challenge.nonce, welcome.session),
                               ring is not None, arena, probe))  # fmt: skip
        # A send that makes no progress for a heartbeat timeout means a frozen or vanished
        # learner; the blocking send holds the I/O thread, so the heartbeat could not tell.
        timeout = min(self._state.config.frame_timeout, self._state.config.heartbeat_timeout)
        if ring is not None:
            # The arena goes with the Attach; the learner's Ready says whether it mapped it.
            self._state.sender = shm.ShmSender(data.sock, ring, timeout, self.arena)
        else:
            self._state.sender = TcpSender(data.sock, self._state.loop, timeout, self._state.config.tcp_congestion)

    async def _open_data_connection(self) -> tuple[ControlConnection, _wire.Challenge]:
        """Open the data connection. In a storm of actors the learner may turn it away at its
        cap of connections not yet authenticated, although this actor's session is already
        set up: retry it alone (within the attempt's timeout) rather than the whole session."""
        delay = 0.02
        while True:
            try:
                return await self._open()
            except (ConnectError, PeerLost):
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, 0.5)

    def _frame_memory_bytes(self) -> int:
        """Room for every frame buffer the actor may hold: those kept for resending, those
        being filled, and a few spare (beyond it, frame buffers are plain memory, and on the
        shm plane their frames go through the ring)."""
        c = self._state.config
        return c.resend_buffer_bytes + (c.frame_buffers + 4) * c.frame_bytes

    def _new_arena(self) -> shm.Arena | None:
        try:
            return shm.Arena(self._frame_memory_bytes(), ahead=2 * self._state.config.frame_bytes)
        except OSError as exc:
            log.info("no shared frame buffers (%s): frames go through the ring", exc)
            return None

    def release_arena(self) -> None:
        """After close: drop the frame buffers and unmap the arena (any thread)."""
        if self._frame_reserve is not None:
            self._frame_reserve.close()
        arena, self.arena = self.arena, None
        if arena is not None:
            with self._state.changed:
                self._state.free.clear()
                self._state.inflight.clear()
                self._state.queue.clear()
            self._state.tasks.clear()  # a stopped task's frame may still hold the frame it was sending
            arena.close()

    def frame_memory(self, nbytes: int) -> Any:
        """Memory for a new frame buffer: from the arena, else from a populated reserve, while
        they have room; else None (plain memory)."""
        if self.arena is not None:
            return self.arena.block(nbytes)
        if self._frame_reserve is None:
            self._frame_reserve = Reserve(self._frame_memory_bytes(), "frames", ahead=2 * self._state.config.frame_bytes)
        return self._frame_reserve.take(nbytes)

    def _map_shm_ring(self, welcome: _wire.Welcome) -> shm.ShmRing | None:
        """Map the learner's ring; None (tcp on the data connection instead) where it cannot be
        reached from here, e.g. another PID namespace or user, unless shm was requested."""
        try:
            pid, fd, nonce, size = welcome.shm or [0, 0, b"", 0]
            return shm.ShmRing.open(int(pid), int(fd), bytes(nonce), int(size))
        except (OSError, ValueError, TypeError) as exc:
            if self._state.transport_wanted == "shm":
                raise Rejected(f"shm requested but the learner's ring cannot be mapped here: {exc}") from exc
            reason = f"auto: the learner's shared-memory ring cannot be mapped here ({exc}); tcp instead"
            log.info(reason)
            self._state.welcome = msgspec.structs.replace(welcome, transport="tcp", reason=reason)
            return None

    # --- the learner's answers (loop thread) ---------------------------------------------------
    def proof(self, mac: bytes) -> None:
        """The learner's AttachProof: checked when its Ready comes."""
        self._attach_proof = mac

    def ready(self, msg: _wire.Ready) -> None:
        """The learner's Ready: the plane is usable once its attach is proven; on shm, whether
        it mapped our arena and may read our memory directly."""
        self._check_attach(msg)
        sender = self._state.sender
        if isinstance(sender, shm.ShmSender):
            if not msg.arena:
                sender.arena = None  # the learner could not map it: use the ring
            sender.direct = msg.cma

    def _check_attach(self, ready: _wire.Ready) -> None:
        """A tcp or shm data plane is used only once the learner proved, with the session's
        key, that it attached it: something without the token that took the data connection
        cannot make the actor stream to it. (A ucx plane's Ready comes with the Welcome.)"""
        proof, self._attach_proof = self._attach_proof, None
        welcome = self._state.welcome
        if ready.transport not in ("tcp", "shm") or self._state.proved_token is None or welcome is None:
            return
        expected = _keys.attach_proof(self._state.weights_key(), welcome.session, ready.transport)
        if proof is None or not hmac.compare_digest(expected, proof):
            raise AuthError("the learner did not prove it attached this session's data connection")


def cuda_visible() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())

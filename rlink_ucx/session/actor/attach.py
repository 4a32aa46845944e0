"""Actor side, the data plane's attach: the plane the learner chose (``transport/plane.py``)
attached after the Welcome and checked when the learner's Ready comes, and the memory the frame
buffers live in (``transport/frame_memory.py``)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import AuthError, ConfigError, ConnectError, PeerLost, ProtocolError
from ...transport.address import is_loopback
from ...transport.control import ControlConnection
from ...transport.frame_memory import FrameMemory
from ...transport.plane import ActorSide, attach_proven, get_plane
from ...wire import keys as _keys
from ...wire import messages as _wire
from .state import LinkState

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
        self.memory = FrameMemory(state.config)  # frame buffers: the shm plane's arena, or a populated reserve
        self._attach_proof: bytes | None = None  # the learner's AttachProof, checked when Ready comes

    async def attach(self, welcome: _wire.Welcome) -> None:
        """Attach the plane the Welcome names (the learner's Ready follows on the control channel)."""
        state, conn = self._state, self._state.control
        assert conn is not None
        try:
            plane = get_plane(welcome.transport)
        except ConfigError as exc:
            raise ProtocolError(f"the learner chose an unknown data plane {welcome.transport!r}") from exc
        attached = await plane.connect(ActorSide(welcome, state.config, state.loop, state.transport_wanted,
                                                 is_loopback(state.host), conn.sock, state.weights_key(),
                                                 state.incarnation, self.memory, self._open_data_connection))  # fmt: skip
        state.welcome = attached.welcome
        state.sender = attached.sender

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

    def release_arena(self, drop_frames: Callable[[], None]) -> None:
        """After close: drop the frame buffers (``drop_frames``: the outbox forgets them) and
        unmap the arena (any thread)."""
        arena = self.memory.release()
        if arena is not None:
            drop_frames()
            self._state.tasks.clear()  # a stopped task's frame may still hold the frame it was sending
            arena.close()

    def frame_memory(self, nbytes: int) -> Any:
        """Memory for a new frame buffer, or None (plain memory)."""
        return self.memory.take(nbytes)

    # --- the learner's answers (loop thread) ---------------------------------------------------
    def proof(self, mac: bytes) -> None:
        """The learner's AttachProof: checked when its Ready comes."""
        self._attach_proof = mac

    def ready(self, msg: _wire.Ready) -> None:
        """The learner's Ready: the plane is usable once its attach is proven; the sender
        learns what the learner could do on its side (on shm: map our arena, read our memory)."""
        self._check_attach(msg)
        sender = self._state.sender
        if sender is not None:
            sender.on_ready(msg.answer)

    def _check_attach(self, ready: _wire.Ready) -> None:
        """A plane with a data connection is used only once the learner proved, with the
        session's key, that it attached it: something without the token that took the data
        connection cannot make the actor stream to it. (A plane without one, such as ucx, is
        attached with the Welcome.)"""
        proof, self._attach_proof = self._attach_proof, None
        welcome = self._state.welcome
        if not attach_proven(ready.transport) or self._state.proved_token is None or welcome is None:
            return
        expected = _keys.attach_proof(self._state.weights_key(), welcome.session, ready.transport)
        if proof is None or not hmac.compare_digest(expected, proof):
            raise AuthError("the learner did not prove it attached this session's data connection")


def cuda_visible() -> bool:
    """Whether CUDA is usable, without importing torch (nor tripping on a torch that another
    thread is importing right now)."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except AttributeError:  # torch.cuda itself half imported
        return False

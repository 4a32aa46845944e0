"""The ``ucx`` plane's actor side: one UCX worker, one endpoint to the learner's worker (its
address comes over the authenticated control channel); per frame, one message of the header
and the small fields (``ucx_setup.inline_fields``), then one per other field, sent with the
session's two tags, one frame at a time (docs/transports.md, "Why one frame in
flight"). The learner's side is ``ucx.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import time
from typing import TYPE_CHECKING, Any

from ..errors import PeerLost, ProtocolError
from . import ucx_probe
from .ucx_setup import (
    HEADER_KIND,
    PAYLOAD_KIND,
    SPINS_BEFORE_YIELD,
    inline_fields,
    load_ucxx,
    make_worker,
    session_tags,
)
from .ucx_unexpected import DISCARD, Sweeper

if TYPE_CHECKING:
    from ..config import Config
    from ..wire.messages import Welcome

__all__ = ["UcxActorPlane"]


class UcxActorPlane:
    """The actor's side: one worker, one endpoint to the learner; sends in frame order."""

    name = "ucx"
    # UCX workers run in single-thread mode: only the thread that made the worker (the actor's
    # I/O loop) may touch it, so callers must not send from their own threads.
    any_thread = False

    def __init__(self, u: Any, context: Any, worker: Any, endpoint: Any, tags: tuple[int, int],
                 loop: asyncio.AbstractEventLoop, config: Config, control: socket.socket | None = None):  # fmt: skip
        _, self.Array = load_ucxx()
        self.u, self._context, self.worker, self.endpoint = u, context, worker, endpoint
        self.tags = tuple(u.UCXXTag(t) for t in tags)  # indexed by kind
        # We never receive: whatever arrives at our worker is a stranger's, thrown away.
        self._sweeper = Sweeper(u, self.Array)
        self.loop = loop
        self.config = config
        # A session the learner ended (dropped, or moved to a fresh worker) never completes our
        # pending send, and the EOF on the control channel is read by the loop this send
        # blocks. So the send watches the control socket for the learner's FIN itself.
        self._control_poll: select.poll | None = None
        if control is not None:
            self._control_poll = select.poll()
            self._control_poll.register(control, select.POLLRDHUP)

    @classmethod
    async def connect(cls, loop: asyncio.AbstractEventLoop, welcome: Welcome, session_key: bytes, incarnation: int,
                      config: Config, loopback: bool = False, control: socket.socket | None = None) -> UcxActorPlane:  # fmt: skip
        if not welcome.ucx_address:
            raise ProtocolError("learner chose ucx but sent no worker address")
        devices = None
        if not loopback and control is not None:  # the interface our control channel left by
            devices = await loop.run_in_executor(None, ucx_probe.net_devices, control.getsockname()[0])
        u, context, worker = make_worker(config, loopback, devices)
        address = u.UCXAddress.create_from_buffer(welcome.ucx_address)
        try:
            endpoint = u.UCXEndpoint.create_from_worker_address(worker, address, False)
        except u.UCXError as exc:  # the worker it names is gone (recycled, or its learner restarted)
            raise PeerLost(f"the learner's ucx worker is unreachable ({type(exc).__name__}: {exc})") from exc
        return cls(u, context, worker, endpoint, session_tags(session_key), loop, config, control)

    def on_ready(self, *, arena: bool, direct: bool) -> None:
        """Nothing to learn from the learner's Ready on this plane."""

    def send(self, header: bytes, payload: list[memoryview]) -> None:
        tag_header, tag_payload = self.tags[HEADER_KIND], self.tags[PAYLOAD_KIND]
        inline = inline_fields(len(view) for view in payload)
        message = bytearray(header)  # UCX needs a writable, contiguous buffer
        for view, ride in zip(payload, inline):
            if ride:  # small fields ride along (ucx_setup.inline_fields)
                message += view
        keep = [self.Array(message)]
        requests = [self.endpoint.tag_send(keep[0], tag_header)]
        for view, ride in zip(payload, inline):
            if len(view) and not ride:
                keep.append(self.Array(view))
                requests.append(self.endpoint.tag_send(keep[-1], tag_payload))
        deadline = time.monotonic() + self.config.frame_timeout
        spins = 0
        # Progress on the sending thread until every buffer is handed over (the worker is only
        # touched under the connection's send lock).
        while not all(r.completed for r in requests):
            self.worker.progress()
            spins += 1
            if spins > SPINS_BEFORE_YIELD:  # a long send yields too: cheap when no one else waits
                os.sched_yield()
            if spins % 256 == 0:
                if time.monotonic() > deadline:
                    raise PeerLost(f"ucx send did not complete within {self.config.frame_timeout}s")
                if self._control_poll is not None and self._control_poll.poll(0):
                    raise PeerLost("the learner ended the session while a frame was being sent")
        for request in requests:
            request.check_error()
        self._sweeper.sweep(self.worker, lambda tag, length: DISCARD)

    def close(self) -> None:
        if self.endpoint is None:
            return
        with contextlib.suppress(Exception):  # best effort at shutdown
            self.endpoint.close_blocking(10**9, 1)  # bounded (ns): never hang on a dead peer
        # Release the worker now (its TCP listener and shared memory), not when the Actor
        # object happens to be collected.
        self.endpoint = self.worker = self._context = None

"""An actor's memory for frame buffers, kept for as long as the actor lives (across reconnects).

On the shm plane it is the actor's arena (``shm.memory.Arena``), which the learner maps and
reads frames from in place; elsewhere a reserve populated ahead of use (``_memory.Reserve``).
The shm plane's direct-read probe (``cma.Probe``) lives here too: the learner reads it at each
attach.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .._memory import Reserve
from .shm import cma
from .shm.memory import Arena

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)


class FrameMemory:
    """Where an actor's frame buffers come from."""

    def __init__(self, config: Config):
        self.config = config
        self.arena: Arena | None = None  # shm plane: frame buffers the learner can read directly
        self.reserve: Reserve | None = None  # the other planes: frame buffers in populated memory
        self.probe: cma.Probe | None = None  # shm: lets the learner prove it may read our memory
        self._first_taken = False  # the first frame buffer off the arena was handed out (as plain memory)

    @property
    def nbytes(self) -> int:
        """Room for every frame buffer the actor may hold: those kept for resending, those
        being filled, and a few spare (beyond it, frame buffers are plain memory, and on the
        shm plane their frames go through the ring)."""
        c = self.config
        return c.resend_buffer_bytes + (c.frame_buffers + 4) * c.frame_bytes

    def shared(self) -> Arena | None:
        """The arena, made at the first shm attach. Only while the actor keeps sent frames
        until they are acknowledged: it never refills a frame buffer the learner may be
        reading. None where it cannot be made (frames then go through the ring)."""
        if self.arena is None and self.config.resend_buffer_bytes > 0:
            try:
                # Nothing populated until the second frame buffer is taken (see ``take``).
                self.arena = Arena(self.nbytes, ahead=2 * self.config.frame_bytes, lazy=True)
            except OSError as exc:
                log.info("no shared frame buffers (%s): frames go through the ring", exc)
        return self.arena

    def cma_probe(self) -> cma.Probe | None:
        """The probe the learner reads to prove it may read our memory (None: direct reads off)."""
        if self.probe is None and self.config.shm_direct_read and cma.available():
            self.probe = cma.Probe()
        return self.probe

    def take(self, nbytes: int) -> Any:
        """Memory for a new frame buffer: from the arena, else from a populated reserve, while
        they have room; else None (plain memory).

        Off the arena, the first frame buffer is plain memory and the reserve is made for the
        second: a slow actor never needs a second buffer and touches a few pages of its first
        (each step leaves at once), and a reserve populated for it, two frames ahead, cost every
        actor 3 MiB of page faults and two threads in a storm of first puts (docs/benchmarks.md,
        "Lockstep bursts"). The arena (lazy) likewise populates nothing for the first frame buffer
        (its few pages are faulted in as steps are written) and keeps two frames ahead from the
        second on: 256 shm actors made 512 threads and 768 MiB of page faults in the first second."""
        if self.arena is not None:
            return self.arena.block(nbytes)
        if not self._first_taken:
            self._first_taken = True
            return None
        if self.reserve is None:
            self.reserve = Reserve(self.nbytes, "frames", ahead=2 * self.config.frame_bytes)
        return self.reserve.take(nbytes)

    def release(self) -> Arena | None:
        """After close: close the reserve and hand over the arena, for the caller to close once
        it dropped its frame buffers (any thread)."""
        if self.reserve is not None:
            self.reserve.close()
        arena, self.arena = self.arena, None
        return arena

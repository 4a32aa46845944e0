"""Tagged messages nobody asked for, thrown away before they pile up in a UCX worker.

UCX keeps a message that matches no posted receive ("unexpected"), eager ones with their
bytes, until a receive with its tag is posted: for a peer that never authenticated, or a
session that has ended, that is never. Anyone who can reach the worker (its TCP ports are
open to its network) could fill the learner's memory that way: 200 MiB of 4 KiB messages
with made-up tags grew a learner by 254 MiB before this. A :class:`Sweeper` looks at the
oldest unexpected message after every progress round and takes it off the queue, into a
small scratch buffer, unless the owner of the worker keeps it (a session's next message,
read in turn once its receive is posted) or takes it itself (the learner reads each frame
header this way, so a session waiting for its next frame posts no receive and costs nothing
per round). Behind a kept message the queue is searched by tag bits every few milliseconds,
so one that stays (an actor stalled mid-frame with its next header sent) shelters nothing
behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_SCRATCH_BYTES = 64 * 1024  # longer messages are received truncated: their bytes never land
_IN_FLIGHT = 256  # discarding receives not yet complete (rendezvous ones wait for the sender)
_PER_SWEEP = 1024  # messages one sweep may discard, so a flood cannot hold the thread
_AROUND_EVERY = 0.01  # seconds between searches past a kept message (64 probes, ~10 us)

# What the worker's owner says of an unexpected message (``triage(tag, length)``).
KEEP = 0  # leave it queued: its receive will be posted (or it will be taken) in turn
DISCARD = 1  # nobody's: receive it into scratch and forget it
TAKEN = 2  # the owner received it itself (``take``), during the call


class Sweeper:
    """Walks one worker's unexpected messages, oldest first, discarding or handing each to its
    owner as the owner's triage says (call on the worker's thread)."""

    def __init__(self, u: Any, array: Any):
        self.u = u
        self._any, self._any_mask = u.UCXXTag(0), u.UCXXTagMask(0)
        self._scratch = array(bytearray(_SCRATCH_BYTES))
        self._pending: list[Any] = []  # discarding receives in flight: UCX writes into scratch
        self._next_around = 0.0
        self.discarded = 0

    def sweep(self, worker: Any, triage: Callable[[int, int], int]) -> int:
        """Take unexpected messages off ``worker``'s queue, oldest first, while
        ``triage(tag, length)`` says DISCARD (or TAKEN: it received the message itself); past
        the first one kept, every ``_AROUND_EVERY`` seconds, search by tag bit for the others.
        Returns how many messages left the queue."""
        self._pending = [r for r in self._pending if not r.completed]
        n, kept = 0, None
        while n < _PER_SWEEP:
            head = worker.tag_probe(self._any, self._any_mask)  # the oldest, left in place
            if not head.matched:
                break
            tag = _value(head.sender_tag)
            verdict = triage(tag, head.length)
            if verdict == KEEP:
                kept = tag
                break
            if not self._handle(worker, tag, verdict):
                break  # too many discards in flight: the rest waits a round
            n += 1
        now = time.monotonic()
        if kept is not None and now >= self._next_around:
            self._next_around = now + _AROUND_EVERY
            n += self._around(worker, kept, triage, _PER_SWEEP - n)
        return n

    def _handle(self, worker: Any, tag: int, verdict: int) -> bool:
        """Carry out ``verdict`` on the oldest message with ``tag``: did it leave the queue?"""
        if verdict == TAKEN:
            return True
        if verdict == DISCARD and self._take(worker, tag):
            self.discarded += 1
            return True
        return False

    def _around(self, worker: Any, kept: int, triage: Callable[[int, int], int], budget: int) -> int:
        """Handle messages queued behind ``kept``: every other tag differs from it in some bit,
        and a probe with a one-bit mask finds the oldest message differing there."""
        n = 0
        for bit in range(64):
            mask = 1 << bit
            while n < budget:
                found = worker.tag_probe(self.u.UCXXTag(~kept & mask), self.u.UCXXTagMask(mask))
                if not found.matched:
                    break
                tag = _value(found.sender_tag)
                if not self._handle(worker, tag, triage(tag, found.length)):
                    break  # another session's next message: what hides behind it waits a round
                n += 1
        return n

    def _take(self, worker: Any, tag: int) -> bool:
        """Receive the oldest message with exactly ``tag`` into the scratch buffer."""
        if len(self._pending) >= _IN_FLIGHT:
            return False
        taken = worker.tag_probe(self.u.UCXXTag(tag), self.u.UCXXTagMaskFull, True)
        if not taken.matched:  # pragma: no cover - nothing else takes it on this thread
            return False
        request = worker.tag_recv_with_handle(self._scratch, taken)
        if not request.completed:
            self._pending.append(request)
        return True


def _value(tag: Any) -> int:
    return int(getattr(tag, "value", tag))  # a UCXXTag (an int in older ucxx)

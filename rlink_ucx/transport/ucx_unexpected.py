"""Tagged messages nobody asked for, thrown away before they pile up in a UCX worker.

UCX keeps a message that matches no posted receive ("unexpected"), eager ones with their
bytes, until a receive with its tag is posted: for a peer that never authenticated, or a
session that has ended, that is never. Anyone who can reach the worker (its TCP ports are
open to its network) could fill the learner's memory that way: 200 MiB of 4 KiB messages
with made-up tags grew a learner by 254 MiB before this. A :class:`Sweeper` looks at the
oldest unexpected message after every progress round and takes it off the queue, into a
small scratch buffer, unless the owner of the worker keeps it (a session's next message,
read in turn once its receive is posted). Behind a kept message the queue is searched by
tag bits every few milliseconds, so one that stays (an actor stalled mid-frame with its next
header sent) shelters nothing behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_SCRATCH_BYTES = 64 * 1024  # longer messages are received truncated: their bytes never land
_IN_FLIGHT = 256  # discarding receives not yet complete (rendezvous ones wait for the sender)
_PER_SWEEP = 1024  # messages one sweep may discard, so a flood cannot hold the thread
_AROUND_EVERY = 0.01  # seconds between searches past a kept message (64 probes, ~10 us)


class Sweeper:
    """Discards one worker's unexpected messages, oldest first (call on the worker's thread)."""

    def __init__(self, u: Any, array: Any):
        self.u = u
        self._any, self._any_mask = u.UCXXTag(0), u.UCXXTagMask(0)
        self._scratch = array(bytearray(_SCRATCH_BYTES))
        self._pending: list[Any] = []  # discarding receives in flight: UCX writes into scratch
        self._next_around = 0.0
        self.discarded = 0

    def sweep(self, worker: Any, discard: Callable[[int], bool]) -> int:
        """Take unexpected messages off ``worker``'s queue, oldest first, while ``discard(tag)``
        says so; past the first one kept, every ``_AROUND_EVERY`` seconds, search by tag bit
        for the others. Returns how many were discarded."""
        self._pending = [r for r in self._pending if not r.completed]
        n, kept = 0, None
        while n < _PER_SWEEP:
            head = worker.tag_probe(self._any, self._any_mask)  # the oldest, left in place
            if not head.matched:
                break
            tag = _value(head.sender_tag)
            if not discard(tag):
                kept = tag
                break
            if not self._take(worker, tag):
                break
            n += 1
        now = time.monotonic()
        if kept is not None and now >= self._next_around:
            self._next_around = now + _AROUND_EVERY
            n += self._around(worker, kept, discard, _PER_SWEEP - n)
        self.discarded += n
        return n

    def _around(self, worker: Any, kept: int, discard: Callable[[int], bool], budget: int) -> int:
        """Discard messages queued behind ``kept``: every other tag differs from it in some bit,
        and a probe with a one-bit mask finds the oldest message differing there."""
        n = 0
        for bit in range(64):
            mask = 1 << bit
            while n < budget:
                found = worker.tag_probe(self.u.UCXXTag(~kept & mask), self.u.UCXXTagMask(mask))
                if not found.matched:
                    break
                tag = _value(found.sender_tag)
                if not discard(tag) or not self._take(worker, tag):
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

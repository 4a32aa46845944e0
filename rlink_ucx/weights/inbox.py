"""The weights messages an actor gets on its control connection, in order, except that each
version's WeightsKey and Seal are kept by version until the read that needs them asks.

A version read from shared memory gets its key and Seal right after its Mapped; a version
passed on by a relay (``relay.py``) gets them from the learner while its bytes are still on
their way through other hosts, so they may arrive before or after that version's bytes, and
between other messages.
"""

from __future__ import annotations

import collections
import queue
import time
from typing import Any

from ..errors import ProtocolError
from ..wire import messages as _wire

__all__ = ["Inbox"]

KEEP = 16  # keys and Seals kept for versions nobody asked for yet (the newest)
_KEYED = (_wire.WeightsKey, _wire.Seal)


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._kept: dict[tuple[type, int], Any] = {}
        self._later: collections.deque[Any] = collections.deque()  # set aside while a key was awaited

    def put(self, msg: Any) -> None:
        """From any thread (the I/O loop)."""
        self._queue.put(msg)

    def get(self, timeout: float) -> Any | None:
        """The next message that is not a key or a Seal (those are kept); None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if self._later:
                return self._later.popleft()
            try:
                msg = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if not isinstance(msg, _KEYED):
                return msg
            self._keep(msg)

    def wait_for(self, kind: type, version: int, timeout: float) -> Any:
        """``version``'s ``kind`` (WeightsKey or Seal), waiting up to ``timeout`` for it; other
        messages that arrive meanwhile are set aside for :meth:`get`."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._kept.pop((kind, version), None)
            if msg is not None:
                return msg
            left = deadline - time.monotonic()
            try:
                msg = self._queue.get(timeout=max(0.0, left)) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                raise ProtocolError(f"no {kind.__name__} for weights version {version}") from None
            if isinstance(msg, _KEYED):
                self._keep(msg)
            else:
                self._later.append(msg)

    def _keep(self, msg: Any) -> None:
        self._kept[(type(msg), msg.version)] = msg
        while len(self._kept) > KEEP:  # versions nobody will read: the oldest go
            del self._kept[min(self._kept, key=lambda k: k[1])]

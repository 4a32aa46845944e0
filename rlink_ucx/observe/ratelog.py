"""Log lines that a storm cannot multiply: per kind, a few lines, then one per period that says
how many were held back. A token holder's reconnect loop or a stranger's connection flood
otherwise writes a line per connection (tens of thousands a minute) and buries everything else."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most ``burst`` records of each kind per ``every`` seconds; the first record after a
    quiet spell says how many of that kind were held back. Thread-safe."""

    def __init__(self, logger: logging.Logger, *, every: float = 10.0, burst: int = 5):
        self.logger = logger
        self._every = every
        self._burst = burst
        self._lock = threading.Lock()
        self._window: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, logged, held back)

    def log(self, level: int, kind: str, msg: str, *args: Any, logger: logging.Logger | None = None) -> None:
        """Log ``msg % args`` at ``level`` (on ``logger``, else this one's) unless ``kind``
        already used its lines this period."""
        logger = self.logger if logger is None else logger
        if not logger.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            start, logged, held = self._window.get(kind, (now, 0, 0))
            if now - start >= self._every:
                start, logged = now, 0
            if logged >= self._burst:
                self._window[kind] = (start, logged, held + 1)
                return
            self._window[kind] = (start, logged + 1, 0)
        if held:
            msg += f" ({held} more like it in the last {self._every:g}s not logged)"
        logger.log(level, msg, *args)

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def info(self, kind: str, msg: str, *args: Any) -> None:
        self.log(logging.INFO, kind, msg, *args)

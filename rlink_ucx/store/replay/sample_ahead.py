"""Batches sampled ahead of the caller by threads that gather side by side.

A uniform sample of large steps from a host table is a copy bound by memory bandwidth. Two
threads that each gather whole batches into their own staging reach more of it than one
gather split in two (no hand-off inside a batch), and they run while the caller trains, as
Reverb's and tf.data's in-flight samples do. ``ReplayCore`` lets them copy at the same time
(rows are found under its lock and copied outside it).

Only where drawing early changes nothing the caller relies on but timing: the uniform
sampler, no rate limiter (an early draw would count against its band before the caller asked),
no seed (batches come in the order the threads finish them), batches on the CPU. A batch may
have been drawn up to ``depth`` batches before :meth:`SampleAhead.get` returns it, so it may
hold items evicted since; its ``staleness`` is computed when it is returned.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

from ...batch import Batch
from ...errors import Closed
from ...errors import TimeoutError as RLinkTimeout
from .core import ReplayCore

__all__ = ["SampleAhead"]

log = logging.getLogger(__name__)

_POLL = 0.25  # seconds a thread waits in one sample() before it looks whether it should stop


class SampleAhead:
    """Keeps up to ``depth`` batches drawn or being drawn, by ``threads`` threads, started at
    the first :meth:`get`. ``core`` is the replay's ``ReplayCore``."""

    def __init__(self, core: ReplayCore, depth: int, threads: int):
        self.core = core
        self.depth = depth
        self.threads = threads
        self.cond = threading.Condition()
        self.ready: collections.deque[Batch] = collections.deque()
        self.busy = 0  # threads inside core.sample
        self.stopped = False  # closed, or a thread met an error: callers sample themselves from then on
        self.started = False
        self._threads: list[threading.Thread] = []
        # each batch ahead, each thread's and a couple the caller still holds keep their staging
        core.pool.reserve(depth + threads + 2)

    def get(self, timeout: float) -> Batch:
        """The next batch; waits up to ``timeout``. Errors (closed, the inserter failed, too
        few steps) are the replay's own, raised by sampling in the caller's thread."""
        if not self.started:
            self._start()
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.ready and not self.stopped and not self._failed():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.core.timed_out(timeout)
                self.cond.wait(left)
            if self.ready and not self._failed():
                batch = self.ready.popleft()
                self.cond.notify_all()
                version = self.core.version()
                staleness = batch.staleness.numpy()
                np.subtract(version, batch.version.numpy(), out=staleness)
                return batch
        return self.core.sample(max(0.0, deadline - time.monotonic()))

    def _failed(self) -> bool:
        """The replay was closed or its inserter failed: batches drawn before are not handed out."""
        return self.core.closed or self.core.error is not None

    def _start(self) -> None:
        with self.cond:
            if self.started:
                return
            self.started = True
        for i in range(self.threads):
            thread = threading.Thread(target=self._run, name=f"rlink-replay-ahead-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, timeout: float | None = None) -> None:
        """Stop the threads (the replay's ``close``, or its finalizer when it is dropped); with a
        ``timeout``, wait that long for a batch being drawn to finish and the threads to end."""
        with self.cond:
            self.stopped = True
            self.ready.clear()
            self.cond.notify_all()
        if timeout is None:
            return
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.stopped and len(self.ready) + self.busy >= self.depth:
                    self.cond.wait()
                if self.stopped:
                    return
                self.busy += 1
            batch = None
            try:
                batch = self.core.sample(_POLL, split=False)
            except RLinkTimeout:
                pass  # too few steps yet: try again
            except BaseException as exc:  # noqa: BLE001 - the caller's own sample() raises it again
                if not isinstance(exc, Closed) and not self.stopped:
                    log.warning("replay: drawing batches ahead stopped (%r); sample() draws them itself from now on", exc)
                with self.cond:
                    self.stopped = True
            finally:
                with self.cond:
                    self.busy -= 1
                    if batch is not None and not self.stopped:
                        self.ready.append(batch)
                    self.cond.notify_all()

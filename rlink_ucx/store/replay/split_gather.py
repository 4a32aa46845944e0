"""A table's batch gather split between the caller and one helper thread.

A batch of large steps (256 Atari steps: 7.2 MB) is a copy bound by memory bandwidth, and one
core does not reach all of it. ``np.take`` of plain bytes releases the GIL, so a second thread
copying other rows of the same batch adds bandwidth where a second core is free.

The rows are cut into chunks that the caller and the helper claim one at a time from a shared
counter, so neither waits for a fixed half: a helper that is not running (both cores busy with
other work) claims nothing, and the caller copies every chunk itself. The caller returns only
once no chunk is being copied, so the batch is whole and no row is read after the caller lets
inserts overwrite them, which also means it waits for a helper the system descheduled in the
middle of a chunk: :class:`Chooser` times both ways and splits only while that is faster. One
helper serves every table of the process, one gather at a time.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time

import numpy as np

__all__ = ["SPLIT_MIN_BYTES", "Chooser", "gather_rows"]

# Gathers smaller than this stay on the caller's thread: waking the helper costs ~10-50 us.
SPLIT_MIN_BYTES = 2 << 20
_CHUNK_BYTES = 512 << 10  # one claim: small enough that the two threads finish together
# The helper is used where there is a second core (os.cpu_count); tests set this to force it.
enabled = (os.cpu_count() or 1) > 1


def gather_rows(pairs: list[tuple[np.ndarray, np.ndarray]], rows: np.ndarray, split: bool = True) -> None:
    """For each ``(storage, out)``: ``out[:] = storage[rows]`` (rows of uint8 ``[n, step_bytes]``).

    Large gathers are split with the helper thread when that has been the faster way lately
    (see :class:`Chooser`) and ``split`` allows it (threads that sample ahead gather whole
    batches side by side instead); the result is exactly that of one ``np.take`` per field.
    """
    big = [(s, o) for s, o in pairs if o.nbytes >= SPLIT_MIN_BYTES]
    if not (enabled and split) or not big or rows.size < 2:
        for storage, out in pairs:
            _take(storage, rows, out)
        return
    started = time.perf_counter()
    job = _Job(big, rows) if chooser.pick() else None
    if job is not None:
        _helper().put(job)
    for storage, out in pairs:
        if job is None or out.nbytes < SPLIT_MIN_BYTES:
            _take(storage, rows, out)  # small fields: not worth a chunk
    if job is not None:
        try:
            job.run()
        finally:  # never leave the helper writing into ``out`` once the caller is gone
            job.close()
    chooser.record(job is not None, time.perf_counter() - started, sum(o.nbytes for _, o in pairs))


class Chooser:
    """Whether to split the next gather. A second core helps only while it is free: on a machine
    whose cores other processes hold, the helper runs late and the caller waits for its chunks
    (docs/replay.md: 0.89x the caller alone at load average 5, 1.24x on a quiet machine).
    So every ``round`` gathers, ``probe`` are timed each way, and the rest of the round goes
    the way whose probes took less time per byte. Probes are few because a split probe on a busy
    machine may wait milliseconds for the helper: 2 of every 128 (Atari batches: ~50 ms apart)
    sampled as fast as 4 of 64 or faster in alternating runs (docs/replay.md)."""

    def __init__(self, round_: int = 128, probe: int = 2):
        self.round, self.probe = round_, probe
        self.n = 0
        self.spent = {True: 0.0, False: 0.0}  # seconds of this round's probes, split or not
        self.moved = {True: 1, False: 1}  # their bytes
        self.best = True

    def pick(self) -> bool:
        i = self.n % self.round
        return i < self.probe if i < 2 * self.probe else self.best

    def record(self, split: bool, seconds: float, nbytes: int) -> None:
        i = self.n % self.round
        self.n += 1
        if i < 2 * self.probe:
            self.spent[split] += seconds
            self.moved[split] += nbytes
        if i == 2 * self.probe - 1:
            self.best = self.spent[True] / self.moved[True] <= self.spent[False] / self.moved[False]
            self.spent, self.moved = {True: 0.0, False: 0.0}, {True: 1, False: 1}


chooser = Chooser()  # one for the process, as the helper is (tests replace it)


def _take(storage: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    # mode="clip" (the rows are in range): with the default "raise", np.take writes to a
    # temporary and copies that to ``out``, twice the memory traffic (docs/replay.md).
    np.take(storage, rows, axis=0, out=out, mode="clip")


class _Job:
    def __init__(self, pairs: list[tuple[np.ndarray, np.ndarray]], rows: np.ndarray):
        self.pairs = pairs
        self.rows = rows
        self.bounds: list[tuple[int, int, int]] = []  # (field, first row, end row) of each chunk
        for f, (_, out) in enumerate(pairs):
            per = max(1, _CHUNK_BYTES * rows.size // max(1, out.nbytes))
            self.bounds += [(f, lo, min(lo + per, rows.size)) for lo in range(0, rows.size, per)]
        self.claims = itertools.count()  # next() is atomic under the GIL: each chunk is claimed once
        self.lock = threading.Lock()
        self.closed = False  # the caller is done: the helper must not start on this job
        self.started = False  # the helper claimed (or may claim) chunks of this job
        self.finished = threading.Event()  # the helper claims no more and copies nothing
        self.error: BaseException | None = None  # what stopped the helper in a chunk it claimed

    def run(self) -> None:
        """Copy chunks until none is left to claim."""
        while (i := next(self.claims)) < len(self.bounds):
            f, lo, hi = self.bounds[i]
            storage, out = self.pairs[f]
            _take(storage, self.rows[lo:hi], out[lo:hi])

    def close(self) -> None:
        """The caller's end: wait for a chunk the helper is still copying."""
        with self.lock:
            self.closed = True
            started = self.started
        if started:
            self.finished.wait()
        self.pairs, self.rows = [], self.rows[:0]  # the queue may hold this job a while: not the batch
        if self.error is not None:  # a chunk the helper claimed may be missing: no batch
            raise RuntimeError("the replay's gather helper failed") from self.error

    def help(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.started = True
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, the helper goes on
            self.error = exc
        finally:
            self.finished.set()


_jobs: queue.SimpleQueue[_Job] | None = None
_start_lock = threading.Lock()


def _helper() -> queue.SimpleQueue[_Job]:
    global _jobs
    if _jobs is None:
        with _start_lock:
            if _jobs is None:
                jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(jobs,), name="rlink-replay-gather", daemon=True).start()
                _jobs = jobs
    return _jobs


def _forget_helper() -> None:
    global _jobs
    _jobs = None  # a forked child has no helper thread: it starts its own when it needs one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper)


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        jobs.get().help()

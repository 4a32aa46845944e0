"""What the scale benchmark's learner and worker processes share: the step schema, measuring a
process (CPU, RSS, open fds), the message queues, and the entry point of a child process."""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

SCHEMA = {"obs": ("float32", (4,)), "t_ns": ("int64", ()), "actor": ("int32", ()), "seq": ("int64", ())}


# --- measuring a process --------------------------------------------------------------------------
def cpu_s() -> float:
    # CLOCK_PROCESS_CPUTIME_ID, all threads, in nanoseconds: os.times() counts 10 ms ticks, and an
    # actor putting 50 steps/s for 2 s uses less than one tick.
    return time.process_time()


def rss_mib() -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the peak: Linux only has /proc


def open_fds() -> int | None:
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/fd"))
    except OSError:
        return None


def sleep_until(t: float) -> None:
    while True:
        left = t - time.time()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))


class CpuWindow(threading.Thread):
    """This process's CPU seconds between two wall-clock instants (all its threads)."""

    def __init__(self, start_at: float, end_at: float):
        super().__init__(name="scale-cpu-window", daemon=True)
        self.start_at, self.end_at = start_at, end_at
        self.cpu: float | None = None
        self.wall: float | None = None

    def run(self) -> None:
        sleep_until(self.start_at)
        c0, w0 = cpu_s(), time.time()
        sleep_until(self.end_at)
        self.cpu, self.wall = cpu_s() - c0, time.time() - w0

    def result(self, timeout: float) -> tuple[float | None, float | None]:
        self.join(max(0.0, timeout))
        return self.cpu, self.wall


def describe_error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""


# --- the message queues ---------------------------------------------------------------------------
def get_message(q: Any, deadline: float) -> Any:
    """The next message of ``q`` within a second (and before ``deadline``, wall clock), or None."""
    try:
        return q.get(timeout=max(0.01, min(1.0, deadline - time.time())))
    except (queue.Empty, EOFError, OSError):
        return None


def wait_message(q: Any, deadline: float) -> Any:
    """The next message of ``q`` before ``deadline`` (wall clock), or None."""
    while True:
        msg = get_message(q, deadline)
        if msg is not None or time.time() >= deadline:
            return msg


def tell(q: Any, msg: Any) -> None:
    try:
        q.put(msg)
    except (OSError, ValueError):  # closed: the process is finishing (a late actor thread)
        pass


def child_main(error_kind: str, key: Any, body: Callable[..., None], reports: Any, *args: Any) -> None:
    """A child process: ``body(reports, *args)``; a failure is reported as ``(error_kind, key, traceback)``."""
    try:
        body(reports, *args)
    except BaseException:  # noqa: BLE001 - reported to the orchestrator
        reports.put((error_kind, key, traceback.format_exc()))
    finally:
        reports.close()
        reports.join_thread()
        os._exit(0)  # stuck threads (an actor still connecting) must not hold the process

"""What a soak's slow minutes were made of: whose CPU the machine spent, the learner's GC
pauses, and the learner's stacks caught while it stalls.

An hour at scale had minutes whose p99 was 100x the first minute's, one with an 8 s stall,
and the per-minute table could not say whether the learner was busy, collecting garbage,
waiting on something, or crowded out by other work on the machine. Three records answer that:

- :class:`MachineCpu`: cores busy on the whole machine (``/proc/stat``) and in the soak's own
  processes (``/proc/<pid>/stat``) between two reads; the difference is other work, named by its
  busiest processes when it is more than :data:`OTHERS_WORTH_NAMING` cores.
- :class:`GcPauses`: the learner's garbage collections (``gc.callbacks``), their longest pause
  and total time since the last sample.
- :class:`StallWatch`: a thread of the harness that runs ``py-spy dump --nonblocking`` on the
  learner when its samples stop coming (the learner samples from its fetching loop, so a
  stalled learner sends none) or a sample's p99 passes a multiple of the first minute's.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable

OTHERS_WORTH_NAMING = 0.3  # cores of other work worth naming its busiest processes
_TICKS = os.sysconf("SC_CLK_TCK")


def _process_ticks(pid: int) -> tuple[str, int] | None:
    """``(name, user + system clock ticks)`` of process ``pid`` (all its threads), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, int(fields[11]) + int(fields[12])


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait


class MachineCpu:
    """Cores busy between two :meth:`read` calls: machine-wide, the soak's processes, the rest."""

    def __init__(self) -> None:
        self._at = time.monotonic()
        self._busy = _machine_busy_ticks()
        self._procs = self._all_processes()

    @staticmethod
    def _all_processes() -> dict[int, tuple[str, int]]:
        out = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (ticks := _process_ticks(int(entry))) is not None:
                out[int(entry)] = ticks
        return out

    def read(self, soak_pids: set[int]) -> dict:
        """``machine``, ``soak`` and ``others`` in cores since the last read, and ``top_others``
        (name, cores) when the others used more than :data:`OTHERS_WORTH_NAMING` cores. A
        process that ended in between is missing from both sums; one that started counts from 0."""
        now, busy, procs = time.monotonic(), _machine_busy_ticks(), self._all_processes()
        seconds = max(now - self._at, 1e-3) * _TICKS
        used = {pid: (name, ticks - self._procs.get(pid, (name, 0))[1]) for pid, (name, ticks) in procs.items()}
        soak = sum(t for pid, (_, t) in used.items() if pid in soak_pids) / seconds
        machine = (busy - self._busy) / seconds
        others = max(0.0, machine - soak)
        out = {"machine": round(machine, 2), "soak": round(soak, 2), "others": round(others, 2)}
        if others > OTHERS_WORTH_NAMING:
            top = sorted(((t, name) for pid, (name, t) in used.items() if pid not in soak_pids), reverse=True)[:3]
            out["top_others"] = [(name, round(t / seconds, 2)) for t, name in top if t > 0]
        self._at, self._busy, self._procs = now, busy, procs
        return out


class GcPauses:
    """The calling process's garbage collections since the last :meth:`take`: count, total and
    longest pause in milliseconds, and how many were full (generation 2) collections."""

    def __init__(self) -> None:
        self._started = 0.0
        self._reset()
        gc.callbacks.append(self._callback)

    def _reset(self) -> None:
        self.count, self.full, self.total_ms, self.max_ms = 0, 0, 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._started) * 1e3
        self.count += 1
        self.full += info.get("generation") == 2
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def take(self) -> dict:
        out = {"gc_count": self.count, "gc_full": self.full, "gc_ms": round(self.total_ms, 2),
               "gc_max_ms": round(self.max_ms, 2)}  # fmt: skip
        self._reset()
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def stalled(now: float, last_sample: float, interval: float, factor: float = 2.5) -> bool:
    """Whether the learner, which samples every ``interval`` seconds, is late by more than
    ``factor`` intervals (it sends samples from its fetching loop: a stalled learner sends none)."""
    return now - last_sample > factor * interval


class StallWatch:
    """Dumps the learner's stacks (``py-spy dump --nonblocking``: the learner is not paused)
    when it stalls or a sample is slow; at most one dump per ``min_gap`` seconds and
    ``max_dumps`` in all. Without py-spy it records that once and dumps nothing."""

    def __init__(self, learner_pid: Callable[[], int | None], interval: float, *, min_gap: float = 20.0,
                 max_dumps: int = 40, started: float | None = None, py_spy: str | None = None) -> None:  # fmt: skip
        self._pid = learner_pid
        self.interval = interval
        self.min_gap, self.max_dumps = min_gap, max_dumps
        self.started = time.time() if started is None else started
        self.py_spy = py_spy if py_spy is not None else shutil.which("py-spy")  # "": none
        self.captures: list[dict] = []
        self.last_sample = time.monotonic()
        self.paused = False  # the harness is restarting the learner: no samples are expected
        self._last_dump = -1e9
        self._wanted: str | None = None  # a slow sample's reason, for the watching thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="soak-stall-watch", daemon=True)
        if not self.py_spy:
            self.captures.append({"t": 0.0, "reason": "py-spy is not installed: no stacks", "stack": ""})

    def start(self) -> None:
        self._thread.start()

    def sample(self, p99_ms: float | None, slow_ms: float | None) -> None:
        """A sample came (the harness's thread): its p99 above ``slow_ms`` is worth a dump,
        which the watching thread takes (the harness's kills keep their times)."""
        self.last_sample = time.monotonic()
        if p99_ms is not None and slow_ms is not None and p99_ms > slow_ms:
            self._wanted = f"a sample's p99 was {p99_ms:.0f} ms (over {slow_ms:.0f} ms)"

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            wanted, self._wanted = self._wanted, None
            if wanted is not None:
                self.dump(wanted)
            elif not self.paused and stalled(time.monotonic(), self.last_sample, self.interval):
                late = time.monotonic() - self.last_sample
                self.dump(f"no sample from the learner for {late:.1f} s")

    def dump(self, reason: str) -> None:
        pid = self._pid()
        with self._lock:
            now = time.monotonic()
            if not self.py_spy or pid is None or len(self.captures) >= self.max_dumps:
                return
            if now - self._last_dump < self.min_gap:
                return
            self._last_dump = now
        try:
            done = subprocess.run([self.py_spy, "dump", "--nonblocking", "--pid", str(pid)], check=False,
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
            stack = done.stdout or done.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            stack = f"py-spy failed: {exc}"
        with self._lock:
            self.captures.append({"t": round(time.time() - self.started, 1), "reason": reason, "stack": stack})
        print(f"[soak] {time.time() - self.started:7.1f}s {reason}: learner stacks captured", flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(35)

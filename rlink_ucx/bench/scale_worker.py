"""The scale benchmark's worker process: some of the actors, one thread each, streaming steps."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from .scale_process import SCHEMA, CpuWindow, describe_error, sleep_until, tell, wait_message

GOLDEN = 0.6180339887498949  # spreads the actors' phases over the step period


class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.puts = 0
        self.error: tuple[str, str, str] | None = None  # (phase, type, message)


def next_due(due: float, period: float, start_at: float, now: float, together: bool) -> float:
    """The next put's time. Spread: one period on (a late actor catches up). Together: the next
    point of the shared grid ``start_at + k * period`` (lockstep; a late actor skips the points
    it missed, as a vectorised environment that steps at its own speed would)."""
    due += period
    if together and due < now:
        due = start_at + (int((now - start_at) / period) + 1) * period
    return due


def worker_process(reports: Any, w: int, port: int, transport: str, indices: list[int], rate: float,
                   limits: dict[str, float], cmd: Any, start: str = "spread") -> None:  # fmt: skip
    """Run under ``child_main``. Spread: connect the actors on "connect" (schema declared), stream
    on "go". Together: on "go" every actor connects at ``start_at`` with no schema (the first put
    infers it) and puts in lockstep. Then report what each put."""
    from .. import Actor, Config

    deadline = time.time() + limits["timeout"]
    reports.put(("worker-ready", w, os.getpid()))
    msg = wait_message(cmd, deadline)
    if msg is None or msg[0] != "connect":
        return
    config = Config.from_env(connect_timeout=limits["connect"])
    plan: dict[str, float] = {}
    go = threading.Event()
    slots = [_Slot(i) for i in indices]
    period = 1.0 / rate

    together = start == "together"

    def run(slot: _Slot) -> None:
        if together:  # released with the others at start_at
            if not go.wait(max(0.0, deadline - time.time())):
                return
            sleep_until(plan["start_at"])
        t0 = time.time()
        try:
            actor = Actor(f"127.0.0.1:{port}", transport=transport, config=config,
                          schema=None if together else SCHEMA)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported
            slot.error = ("connect", *describe_error(exc))
            tell(reports, ("failed", slot.index, (t0, time.time(), *describe_error(exc))))
            return
        if go.is_set() and not together:  # the stream started without it: the orchestrator counted it as not connected
            slot.error = ("connect", "TimeoutError", "connected after the stream had started")
            actor.close()
            return
        tell(reports, ("connected", slot.index, (t0, time.time(), actor.transport)))
        phase = "stream"
        try:
            if not go.wait(max(0.0, deadline - time.time())):
                raise TimeoutError("no go from the orchestrator")
            end_at = plan["end_at"]
            step: dict[str, np.ndarray] = {"obs": np.zeros(4, np.float32), "t_ns": np.zeros((), np.int64),
                    "actor": np.full((), slot.index, np.int32), "seq": np.zeros((), np.int64)}  # fmt: skip
            t_ns, seq, obs = step["t_ns"], step["seq"], step["obs"]
            put = actor.put
            start_at = plan["start_at"]
            due = start_at if together else start_at + ((slot.index * GOLDEN) % 1.0) * period
            n = 0
            while due < end_at:
                left = due - time.time()
                if left > 0:
                    time.sleep(left)
                seq[()] = n
                obs[0] = n
                t_ns[()] = time.time_ns()
                put(step)
                n += 1
                slot.puts = n
                due = next_due(due, period, start_at, time.time(), together)
            phase = "flush"
            actor.flush(limits["flush"])
        except BaseException as exc:  # noqa: BLE001 - reported
            slot.error = (phase, *describe_error(exc))
        finally:
            try:
                actor.close()
            except BaseException as exc:  # noqa: BLE001 - reported
                slot.error = slot.error or ("close", *describe_error(exc))

    threads = [threading.Thread(target=run, args=(s,), name=f"scale-actor-{s.index}", daemon=True) for s in slots]
    for t in threads:
        t.start()
    msg = wait_message(cmd, deadline)
    if msg is None or msg[0] != "go":
        return
    plan.update(start_at=msg[1], end_at=msg[2])
    window = CpuWindow(msg[1], msg[2])
    window.start()
    go.set()
    for t in threads:
        t.join(max(0.0, min(deadline, msg[2] + limits["flush"] + limits["close"] + 5) - time.time()))
    cpu, wall = window.result(deadline - time.time())
    reports.put(("worker-done", w, {
        "cpu_s": cpu, "wall_s": wall, "still_running": sum(t.is_alive() for t in threads),
        "actors": [(s.index, s.puts, s.error) for s in slots],
    }))  # fmt: skip
    wait_message(cmd, deadline)  # "exit"

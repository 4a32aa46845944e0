"""One row of the scale benchmark (a transport, N actors): starts the learner and worker processes,
steps them through connect, stream and drain, and sums up what they reported."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

from .scale_learner import learner_process
from .scale_process import child_main, get_message
from .scale_worker import worker_process

BATCH_FILL_S = 0.005  # --batch auto: about this many seconds of steps per batch (1 to 32)
STEADY_AFTER_S = 3.0  # steady percentiles: steps put this long after the stream's start
RELEASE_S = 1.0  # --start together: the actors are released this long after "go" is sent


def auto_batch(actors: int, rate: float) -> int:
    """About BATCH_FILL_S seconds of the aggregate stream, 1 to 32 steps."""
    return max(1, min(32, int(actors * rate * BATCH_FILL_S)))


def run_row(transport: str, actors: int, procs: int, rate: float, seconds: float, timeout: float,
            batch: int | None = None, start: str = "spread") -> dict[str, Any]:  # fmt: skip
    """Run one (transport, N) row; returns its record (``error`` set when it did not finish).
    ``start``: "spread" (connect with the schema first, then stream with phases spread over the
    period) or "together" (every actor released at one instant, connecting with no schema,
    putting in lockstep)."""
    procs = max(1, min(procs, actors))
    batch = batch or auto_batch(actors, rate)
    together = start == "together"
    row: dict[str, Any] = {"transport": transport, "actors": actors, "procs": procs, "rate": rate,
                           "seconds": seconds, "batch": batch, "start": start, "error": None}  # fmt: skip
    started = time.time()
    deadline = started + timeout

    def left() -> float:
        return deadline - time.time()

    limits = {"connect": max(5.0, 0.3 * timeout), "flush": max(5.0, 0.15 * timeout), "close": 5.0, "timeout": timeout}
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    learner_cmd = ctx.Queue()
    worker_cmds = [ctx.Queue() for _ in range(procs)]
    procs_all: list[Any] = []
    phase = "start"
    conn: dict[int, tuple[float, float]] = {}
    failed: dict[int, tuple[str, str, str]] = {}
    transports: Counter[str] = Counter()
    done: dict[int, dict[str, Any]] = {}
    learner_info: dict[str, Any] = {}
    result: dict[str, Any] | None = None
    problems: list[str] = []
    ready: set[int] = set()  # worker processes up
    conn_times: list[tuple[float, float]] = []  # of the actors that failed to connect

    def handle(msg: Any) -> None:
        kind, key, value = msg
        if kind == "connected":
            conn[key] = (value[0], value[1])
            transports[value[2]] += 1
            if together and len(conn) == actors:  # the learner's RSS and fds with every actor connected
                learner_cmd.put(("measure",))
        elif kind == "failed":
            conn.pop(key, None)
            failed[key] = ("connect", value[2], value[3])
            conn_times.append((value[0], value[1]))
        elif kind == "worker-ready":
            ready.add(key)
        elif kind == "worker-done":
            done[key] = value
        elif kind == "learner-ready":
            learner_info.update(value)
        elif kind == "learner-result":
            nonlocal result
            result = value
        elif kind in ("learner-error", "worker-error"):
            who = "learner" if kind == "learner-error" else f"worker {key}"
            problems.append(f"{who}: " + value.strip().splitlines()[-1])
            print(f"[scale] {who} failed:\n{value}", file=sys.stderr, flush=True)

    def pump(until: Any, what: str) -> None:
        """Handle messages until ``until()`` holds; raise if the row's time runs out or a process died."""
        while not until():
            if problems:
                raise RuntimeError(problems[0])
            # A process that had exited before a second without messages sent all it will send.
            exited = [p for p in procs_all if p.exitcode is not None]
            msg = get_message(reports, deadline)
            if msg is not None:
                handle(msg)
                continue
            if left() <= 0:
                raise TimeoutError(f"row timed out ({timeout:.0f}s) waiting for {what}")
            dead = [p for p in exited if not finished(p)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited (code {dead[0].exitcode}) while waiting for {what}")

    def finished(p: Any) -> bool:
        """Whether process ``p`` sent its last report (so it may exit)."""
        if p.name == "scale-learner":
            return result is not None
        return int(p.name.rsplit("-", 1)[1]) in done

    try:
        learner = ctx.Process(target=child_main, name="scale-learner", daemon=True,
                              args=("learner-error", None, learner_process, reports, transport, batch, learner_cmd,
                                    timeout))  # fmt: skip
        learner.start()
        procs_all.append(learner)
        phase = "learner start"
        pump(lambda: bool(learner_info), "the learner to listen")
        shares = [list(range(w, actors, procs)) for w in range(procs)]
        workers = [ctx.Process(target=child_main, name=f"scale-worker-{w}", daemon=True,
                               args=("worker-error", w, worker_process, reports, w, learner_info["port"], transport,
                                     shares[w], rate, limits, worker_cmds[w], start))
                   for w in range(procs)]  # fmt: skip
        for p in workers:
            p.start()
            procs_all.append(p)
        phase = "workers start"
        pump(lambda: len(ready) == procs, "the worker processes to start")
        phase = "connect"
        for q in worker_cmds:
            q.put(("connect",))
        if not together:
            connect_deadline = time.time() + limits["connect"] + 15  # the actor's own connect budget, and slack
            pump(lambda: len(conn) + len(failed) >= actors or time.time() >= connect_deadline,
                 "the actors to connect")  # fmt: skip
            _connected(row, actors, conn, failed, conn_times, transports, None)
        phase = "stream"
        start_at = time.time() + (RELEASE_S if together else 0.5)
        end_at = start_at + seconds
        row["start_at"] = start_at
        learner_cmd.put(("go", start_at, end_at, not together))  # together: measured once all connected
        for q in worker_cmds:
            q.put(("go", start_at, end_at))
        pump(lambda: len(done) == procs, "the actors to stream, flush and close")
        if together:  # they connected as they started
            _connected(row, actors, conn, failed, conn_times, transports, start_at)
        phase = "drain"
        learner_cmd.put(("drain",))
        pump(lambda: result is not None, "the learner to drain")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        row["error"] = f"{phase}: {type(exc).__name__}: {exc}"
    finally:
        for q in [learner_cmd, *worker_cmds]:
            try:
                q.put(("stop",) if q is learner_cmd else ("exit",))
            except (OSError, ValueError):
                pass
        _stop(procs_all, min(20.0, max(2.0, left() + 5)))
        reports.close()
        learner_cmd.close()
        for q in worker_cmds:
            q.close()
    row["wall_s"] = time.time() - started
    _summarize(row, actors, conn, failed, done, learner_info, result)
    return row


def _connected(row: dict[str, Any], actors: int, conn: dict[int, tuple[float, float]],
               failed: dict[int, tuple[str, str, str]], conn_times: list[tuple[float, float]],
               transports: Counter[str], start_at: float | None) -> None:  # fmt: skip
    """Count the actors connected (and those not: failed), and the time to connect them all:
    from ``start_at`` (the release), or from the first attempt."""
    row["connected"] = len(conn)
    for i in range(actors):
        if i not in conn and i not in failed:
            failed[i] = ("connect", "TimeoutError", "still connecting when the connect phase ended")
    row["connect_failed"] = len(failed)
    starts = [t0 for t0, _ in conn.values()] + [t0 for t0, _ in conn_times]
    first = start_at if start_at is not None else min(starts, default=0.0)
    row["connect_s"] = max(t1 for _, t1 in conn.values()) - first if conn else None
    row["planes"] = dict(transports)
    if not conn:
        raise RuntimeError("no actor connected")


def _stop(procs: list[Any], timeout: float) -> None:
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _phases(row: dict[str, Any], lat: np.ndarray, result: dict[str, Any]) -> None:
    """First-step percentiles (each actor's seq 0: its connect and schema included in
    together mode) and steady ones (steps put ``STEADY_AFTER_S`` after the stream's start)."""
    first = lat[result["seq"] == 0]
    if len(first):
        p50, p99 = np.percentile(first, [50, 99])
        row.update(first_p50_ms=float(p50), first_p99_ms=float(p99), first_max_ms=float(first.max()),
                   first_over_200ms=int((first > 200).sum()))  # fmt: skip
    if "start_at" in row and "t_ns" in result:
        # when each actor's first step was fetched, from the stream's start (the release, in
        # together mode): connecting, negotiating and the first step's trip together
        fetched = (result["t_ns"][result["seq"] == 0] / 1e9 + first / 1e3) - row["start_at"]
        if len(fetched):
            p50, p99 = np.percentile(fetched, [50, 99])
            row.update(first_fetched_p50_s=float(p50), first_fetched_p99_s=float(p99),
                       first_fetched_max_s=float(fetched.max()))  # fmt: skip
        steady = lat[result["t_ns"] >= int((row["start_at"] + STEADY_AFTER_S) * 1e9)]
        if len(steady):
            p50, p99 = np.percentile(steady, [50, 99])
            row.update(steady_p50_ms=float(p50), steady_p99_ms=float(p99), steady_steps=len(steady))


def _summarize(row: dict[str, Any], actors: int, conn: dict[int, Any], failed: dict[int, tuple[str, str, str]],
               done: dict[int, dict[str, Any]], learner_info: dict[str, Any],
               result: dict[str, Any] | None) -> None:  # fmt: skip
    row.setdefault("connected", len(conn))
    row.setdefault("connect_failed", len(failed))
    errors = [{"actor": i, "phase": ph, "type": t, "message": m} for i, (ph, t, m) in sorted(failed.items())]
    puts = np.zeros(actors, np.int64)
    for rep in done.values():
        for index, n, err in rep["actors"]:
            puts[index] = n
            if err and index not in failed:
                errors.append({"actor": index, "phase": err[0], "type": err[1], "message": err[2]})
    row["died"] = sum(1 for e in errors if e["phase"] != "connect")
    row["errors"] = errors
    row["error_kinds"] = dict(Counter(f"{e['phase']}: {e['type']}: {e['message']}" for e in errors).most_common())
    if learner_info:
        row["learner_rss_before_mib"] = learner_info["rss_mib"]
        row["learner_fds_before"] = learner_info["fds"]
    if result is None:
        return
    row["expected"] = int(puts.sum()) if len(done) == row["procs"] else None
    key = result["actor"] * (1 << 32) + result["seq"]
    unique = np.unique(key)
    row["received"] = len(key)
    row["duplicated"] = int(len(key) - len(unique))
    ua, us = unique >> 32, unique & 0xFFFFFFFF
    valid = (ua >= 0) & (ua < actors)
    counted = valid.copy()
    counted[valid] = us[valid] < puts[ua[valid]]
    row["delivered"] = int(counted.sum())
    row["unexpected"] = int(len(unique) - counted.sum())  # steps no actor counted as put
    if row["expected"] is not None:
        row["lost"] = row["expected"] - row["delivered"]
    lat = result["lat_ns"] / 1e6
    if len(lat):
        p50, p99, p999 = np.percentile(lat, [50, 99, 99.9])
        row.update(p50_ms=float(p50), p99_ms=float(p99), p999_ms=float(p999), max_ms=float(lat.max()))
    _phases(row, lat, result)
    connected = max(1, row["connected"])
    if result["cpu_s"] is not None and result["wall_s"]:
        row["learner_cpu"] = result["cpu_s"] / result["wall_s"]
    cpu = [r["cpu_s"] for r in done.values() if r["cpu_s"] is not None]
    walls = [r["wall_s"] for r in done.values() if r["wall_s"]]
    if cpu and walls and len(cpu) == len(done):
        row["actor_cpu_per_actor"] = sum(cpu) / connected / (sum(walls) / len(walls))
        row["workers_cpu"] = sum(cpu) / (sum(walls) / len(walls))
    if result["connected"]:
        row["learner_rss_after_mib"] = result["connected"]["rss_mib"]
        row["learner_rss_mib_per_actor"] = (result["connected"]["rss_mib"] - learner_info["rss_mib"]) / connected
        row["learner_fds"] = result["connected"]["fds"]
    row["learner_rss_end_mib"] = result["rss_end_mib"]
    row["put_rate"] = (row["expected"] / connected / row["seconds"]) if row.get("expected") is not None else None
    row["learner_stats"] = result["stats"]

"""Scale: many actors into one learner, on each data plane.

Per row (one transport, N actors):

- the learner runs in a process of its own (so its CPU time is its own): ``Learner`` on
  127.0.0.1 port 0 and ``RLinkDataset(batch_size=B)``, fetched in a loop with a short timeout;
- N actors, each a real ``Actor`` on a thread of its own, are spread over P worker processes
  (``--procs``, default min(N, 8); "spawn" start method); every actor declares the schema when
  it connects (so connecting includes schema negotiation), then puts one small step
  (``obs`` float32[4], ``t_ns`` int64 = ``time.time_ns()`` at the put, ``actor`` int32,
  ``seq`` int64) every 1/``--rate`` seconds (phases spread over the period) for ``--seconds``
  after all are connected, then ``flush()`` and ``close()``;
- the learner then drains what is left with a batch size of 1.

Reported per row: connect time (the first actor's start -> the last one connected, all
connecting at once), how many connected / failed to connect (with the error), steps expected
(what the actors' puts returned for) / delivered / duplicated / lost, put->fetch latency
p50 / p99 / p99.9 (the learner's ``time.time_ns()`` when the batch is returned minus ``t_ns``:
it includes waiting for the batch to fill, which is why the default batch size follows the
aggregate rate: about 5 ms of steps, 1 to 32), the learner's CPU (fraction of a core over the
streaming window, ``os.times`` of its process), actor CPU per connected actor (the worker
processes' CPU time in the window / connected actors / window), the learner's RSS growth per
connected actor (after all connected minus before any, MiB; it includes the receive ring,
``Config.buffer_bytes``, which the first schema allocates) and its open file descriptors after
all connected, and every actor that died (phase, exception type and message).

Every wait has a timeout and a row is bounded by ``--timeout``; a row that fails is reported
with what it measured so far, and the processes are killed.

Usage: rlink bench --suite scale [--actors 1,16,64,256] [--procs 8] [--rate 20] [--seconds 10]
       [--transport auto|tcp|shm|ucx[,...]] [--json out.json] [--plot out.png]
       (also python bench/scale.py ...)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

import numpy as np

from .common import installed
from .report import loadavg, machine

MiB = 1 << 20
SCHEMA = {"obs": ("float32", (4,)), "t_ns": ("int64", ()), "actor": ("int32", ()), "seq": ("int64", ())}
FETCH_TIMEOUT = 0.05  # the learner's fetch slice: commands are looked at between fetches
BATCH_FILL_S = 0.005  # --batch auto: about this many seconds of steps per batch (1 to 32)
GOLDEN = 0.6180339887498949  # spreads the actors' phases over the step period


# --- measuring a process --------------------------------------------------------------------------
def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _rss_mib() -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the peak: Linux only has /proc


def _fds() -> int | None:
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/fd"))
    except OSError:
        return None


def _sleep_until(t: float) -> None:
    while True:
        left = t - time.time()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))


class _CpuWindow(threading.Thread):
    """This process's CPU seconds between two wall-clock instants (all its threads)."""

    def __init__(self, start_at: float, end_at: float):
        super().__init__(name="scale-cpu-window", daemon=True)
        self.start_at, self.end_at = start_at, end_at
        self.cpu: float | None = None
        self.wall: float | None = None

    def run(self) -> None:
        _sleep_until(self.start_at)
        c0, w0 = _cpu_s(), time.time()
        _sleep_until(self.end_at)
        self.cpu, self.wall = _cpu_s() - c0, time.time() - w0

    def result(self, timeout: float) -> tuple[float | None, float | None]:
        self.join(max(0.0, timeout))
        return self.cpu, self.wall


def _error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""


def _get(q: Any, deadline: float) -> Any:
    """The next message of ``q`` within a second (and before ``deadline``, wall clock), or None."""
    try:
        return q.get(timeout=max(0.01, min(1.0, deadline - time.time())))
    except (queue.Empty, EOFError, OSError):
        return None


def _wait(q: Any, deadline: float) -> Any:
    """The next message of ``q`` before ``deadline`` (wall clock), or None."""
    while True:
        msg = _get(q, deadline)
        if msg is not None or time.time() >= deadline:
            return msg


def _tell(q: Any, msg: Any) -> None:
    try:
        q.put(msg)
    except (OSError, ValueError):  # closed: the process is finishing (a late actor thread)
        pass


# --- the learner process ------------------------------------------------------------------------------
def _learner_main(transport: str, batch_size: int, cmd: Any, reports: Any, timeout: float) -> None:
    try:
        _learner(transport, batch_size, cmd, reports, timeout)
    except BaseException:  # noqa: BLE001 - reported to the orchestrator
        reports.put(("learner-error", None, traceback.format_exc()))
    finally:
        reports.close()
        reports.join_thread()
        os._exit(0)  # stuck threads must not hold the process


def _learner(transport: str, batch_size: int, cmd: Any, reports: Any, timeout: float) -> None:
    from .. import Config, Learner, RLinkDataset
    from .. import TimeoutError as FetchTimeout

    deadline = time.time() + timeout
    learner = Learner("127.0.0.1:0", transport=transport, config=Config.from_env())
    try:
        dataset = RLinkDataset(learner, batch_size=batch_size)
        tail = RLinkDataset(learner, batch_size=1)
        reports.put(("learner-ready", None, {"port": learner.port, "pid": os.getpid(), "rss_mib": _rss_mib(),
                                             "fds": _fds()}))  # fmt: skip
        actors: list[np.ndarray] = []
        seqs: list[np.ndarray] = []
        lat_ns: list[np.ndarray] = []
        window: _CpuWindow | None = None
        connected: dict[str, Any] = {}
        source, draining = dataset, False
        while time.time() < deadline:
            try:
                msg = cmd.get_nowait()
            except queue.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "go":  # every actor that will connect has: measure, then time the window
                    connected = {"rss_mib": _rss_mib(), "fds": _fds()}
                    window = _CpuWindow(msg[1], msg[2])
                    window.start()
                elif msg[0] == "drain":  # every actor flushed: what is left is in the ring
                    source, draining = tail, True
                elif msg[0] == "stop":
                    return
            try:
                batch = source.fetch(timeout=0.2 if draining else FETCH_TIMEOUT)
            except FetchTimeout:
                if not draining:
                    continue
                break
            now = time.time_ns()
            lat_ns.append(now - batch["t_ns"].numpy())
            actors.append(batch["actor"].numpy().astype(np.int64))
            seqs.append(batch["seq"].numpy().astype(np.int64))
        else:
            raise TimeoutError("the learner's time ran out before the drain")
        cpu, wall = window.result(5.0) if window is not None else (None, None)
        stats = learner.stats()
        cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt)
        reports.put(("learner-result", None, {
            "actor": cat(actors, np.int64), "seq": cat(seqs, np.int64), "lat_ns": cat(lat_ns, np.int64),
            "cpu_s": cpu, "wall_s": wall, "connected": connected, "rss_end_mib": _rss_mib(),
            "stats": {k: stats.get(k) for k in ("connected_actors", "lost_actors", "rejected_connections")},
        }))  # fmt: skip
        _wait(cmd, deadline)  # "stop": the actors are closed by then
    finally:
        learner.close()


# --- a worker process: some of the actors, one thread each --------------------------------------------
class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.puts = 0
        self.error: tuple[str, str, str] | None = None  # (phase, type, message)


def _worker_main(w: int, port: int, transport: str, indices: list[int], rate: float, limits: dict[str, float],
                 cmd: Any, reports: Any) -> None:  # fmt: skip
    try:
        _worker(w, port, transport, indices, rate, limits, cmd, reports)
    except BaseException:  # noqa: BLE001 - reported to the orchestrator
        reports.put(("worker-error", w, traceback.format_exc()))
    finally:
        reports.close()
        reports.join_thread()
        os._exit(0)  # an actor thread still connecting must not hold the process


def _worker(w: int, port: int, transport: str, indices: list[int], rate: float, limits: dict[str, float],
            cmd: Any, reports: Any) -> None:  # fmt: skip
    from .. import Actor, Config

    deadline = time.time() + limits["timeout"]
    reports.put(("worker-ready", w, os.getpid()))
    msg = _wait(cmd, deadline)
    if msg is None or msg[0] != "connect":
        return
    config = Config.from_env(connect_timeout=limits["connect"])
    plan: dict[str, float] = {}
    go = threading.Event()
    slots = [_Slot(i) for i in indices]
    period = 1.0 / rate

    def run(slot: _Slot) -> None:
        t0 = time.time()
        try:
            actor = Actor(f"127.0.0.1:{port}", transport=transport, config=config, schema=SCHEMA)
        except BaseException as exc:  # noqa: BLE001 - reported
            slot.error = ("connect", *_error(exc))
            _tell(reports, ("failed", slot.index, (t0, time.time(), *_error(exc))))
            return
        if go.is_set():  # the stream started without it: the orchestrator counted it as not connected
            slot.error = ("connect", "TimeoutError", "connected after the stream had started")
            actor.close()
            return
        _tell(reports, ("connected", slot.index, (t0, time.time(), actor.transport)))
        phase = "stream"
        try:
            if not go.wait(max(0.0, deadline - time.time())):
                raise TimeoutError("no go from the orchestrator")
            end_at = plan["end_at"]
            step = {"obs": np.zeros(4, np.float32), "t_ns": np.zeros((), np.int64),
                    "actor": np.full((), slot.index, np.int32), "seq": np.zeros((), np.int64)}  # fmt: skip
            t_ns, seq, obs = step["t_ns"], step["seq"], step["obs"]
            put = actor.put
            due = plan["start_at"] + ((slot.index * GOLDEN) % 1.0) * period
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
                due += period
            phase = "flush"
            actor.flush(limits["flush"])
        except BaseException as exc:  # noqa: BLE001 - reported
            slot.error = (phase, *_error(exc))
        finally:
            try:
                actor.close()
            except BaseException as exc:  # noqa: BLE001 - reported
                slot.error = slot.error or ("close", *_error(exc))

    threads = [threading.Thread(target=run, args=(s,), name=f"scale-actor-{s.index}", daemon=True) for s in slots]
    for t in threads:
        t.start()
    msg = _wait(cmd, deadline)
    if msg is None or msg[0] != "go":
        return
    plan.update(start_at=msg[1], end_at=msg[2])
    window = _CpuWindow(msg[1], msg[2])
    window.start()
    go.set()
    for t in threads:
        t.join(max(0.0, min(deadline, msg[2] + limits["flush"] + limits["close"] + 5) - time.time()))
    cpu, wall = window.result(deadline - time.time())
    reports.put(("worker-done", w, {
        "cpu_s": cpu, "wall_s": wall, "still_running": sum(t.is_alive() for t in threads),
        "actors": [(s.index, s.puts, s.error) for s in slots],
    }))  # fmt: skip
    _wait(cmd, deadline)  # "exit"


# --- one row ---------------------------------------------------------------------------------------------
def auto_batch(actors: int, rate: float) -> int:
    """About BATCH_FILL_S seconds of the aggregate stream, 1 to 32 steps."""
    return max(1, min(32, int(actors * rate * BATCH_FILL_S)))


def run_row(transport: str, actors: int, procs: int, rate: float, seconds: float, timeout: float,
            batch: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Run one (transport, N) row; returns its record (``error`` set when it did not finish)."""
    procs = max(1, min(procs, actors))
    batch = batch or auto_batch(actors, rate)
    row: dict[str, Any] = {"transport": transport, "actors": actors, "procs": procs, "rate": rate,
                           "seconds": seconds, "batch": batch, "error": None}  # fmt: skip
    started = time.time()
    deadline = started + timeout
    left = lambda: deadline - time.time()
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
            msg = _get(reports, deadline)
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
        learner = ctx.Process(target=_learner_main, name="scale-learner", daemon=True,
                              args=(transport, batch, learner_cmd, reports, timeout))  # fmt: skip
        learner.start()
        procs_all.append(learner)
        phase = "learner start"
        pump(lambda: bool(learner_info), "the learner to listen")
        shares = [list(range(w, actors, procs)) for w in range(procs)]
        workers = [ctx.Process(target=_worker_main, name=f"scale-worker-{w}", daemon=True,
                               args=(w, learner_info["port"], transport, shares[w], rate, limits, worker_cmds[w],
                                     reports))
                   for w in range(procs)]  # fmt: skip
        for p in workers:
            p.start()
            procs_all.append(p)
        phase = "workers start"
        pump(lambda: len(ready) == procs, "the worker processes to start")
        phase = "connect"
        for q in worker_cmds:
            q.put(("connect",))
        connect_deadline = time.time() + limits["connect"] + 15  # the actor's own connect budget, and slack
        pump(lambda: len(conn) + len(failed) >= actors or time.time() >= connect_deadline, "the actors to connect")
        row["connected"] = len(conn)
        pending = [i for i in range(actors) if i not in conn and i not in failed]
        for i in pending:
            failed[i] = ("connect", "TimeoutError", "still connecting when the connect phase ended")
        row["connect_failed"] = len(failed)
        starts = [t0 for t0, _ in conn.values()] + [t0 for t0, _ in conn_times]
        row["connect_s"] = max(t1 for _, t1 in conn.values()) - min(starts) if conn else None
        row["planes"] = dict(transports)
        if not conn:
            raise RuntimeError("no actor connected")
        phase = "stream"
        start_at = time.time() + 0.5
        end_at = start_at + seconds
        learner_cmd.put(("go", start_at, end_at))
        for q in worker_cmds:
            q.put(("go", start_at, end_at))
        pump(lambda: len(done) == procs, "the actors to stream, flush and close")
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


def _stop(procs: list[Any], timeout: float) -> None:
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


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


# --- the report ------------------------------------------------------------------------------------------
COLUMNS = [  # (header, key, format)
    ("plane", "transport", "{}"), ("N", "actors", "{}"), ("P", "procs", "{}"), ("B", "batch", "{}"),
    ("conn", "connected", "{}"), ("fail", "connect_failed", "{}"), ("conn_s", "connect_s", "{:.2f}"),
    ("expected", "expected", "{}"), ("delivered", "delivered", "{}"), ("dup", "duplicated", "{}"),
    ("lost", "lost", "{}"), ("p50_ms", "p50_ms", "{:.2f}"), ("p99_ms", "p99_ms", "{:.2f}"),
    ("p99.9_ms", "p999_ms", "{:.2f}"), ("lrn_cpu", "learner_cpu", "{:.3f}"),
    ("act_cpu/a", "actor_cpu_per_actor", "{:.4f}"), ("rss_MiB/a", "learner_rss_mib_per_actor", "{:.2f}"),
    ("fds", "learner_fds", "{}"), ("died", "died", "{}"),
]  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    cells = [[h for h, _, _ in COLUMNS]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) is not None else "-" for _, k, fmt in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)), flush=True)
    for r in rows:
        label = f"{r['transport']} x{r['actors']}"
        if r.get("error"):
            print(f"  {label}: row failed: {r['error']}")
        for kind, n in r.get("error_kinds", {}).items():
            print(f"  {label}: {n} actor(s): {kind}")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, cpu) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, transport in enumerate(dict.fromkeys(r["transport"] for r in rows)):
        color = f"C{i}"
        mine = sorted((r for r in rows if r["transport"] == transport and r.get("p50_ms") is not None),
                      key=lambda r: r["actors"])  # fmt: skip
        n = [r["actors"] for r in mine]
        lat.plot(n, [r["p50_ms"] for r in mine], "o-", color=color, label=f"{transport} p50")
        lat.plot(n, [r["p99_ms"] for r in mine], "s--", color=color, label=f"{transport} p99")
        with_cpu = [r for r in mine if r.get("learner_cpu") is not None]
        cpu.plot([r["actors"] for r in with_cpu], [r["learner_cpu"] for r in with_cpu], "o-", color=color,
                 label=transport)  # fmt: skip
    for ax in (lat, cpu):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("actors")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_yscale("log")
    lat.set_ylabel("put -> fetch latency (ms)")
    lat.set_title("latency vs actors")
    cpu.set_ylabel("learner CPU (cores)")
    cpu.set_title("learner CPU vs actors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _transports(value: str) -> list[str]:
    from ..transport import shm

    if value == "auto":
        out = ["tcp"]
        if shm.available():
            out.append("shm")
        if installed("ucxx"):
            out.append("ucx")
        return out
    out = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in out if v not in ("tcp", "shm", "ucx")]
    if bad or not out:
        raise SystemExit(f"unknown transport(s): {', '.join(bad) or value!r} (choose from auto, tcp, shm, ucx)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlink bench --suite scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--actors", default="1,16,64,256", help="comma list of actor counts N (default 1,16,64,256)")
    parser.add_argument("--procs", type=int, default=8, help="worker processes P per row, at most N (default 8)")
    parser.add_argument("--rate", type=float, default=20.0, help="steps per second per actor (default 20)")
    parser.add_argument("--seconds", type=float, default=10.0, help="streaming window after all connected (default 10)")
    parser.add_argument(
        "--transport",
        default="auto",
        help="auto (tcp, shm where it works, ucx when ucxx imports) or a comma list of tcp, shm, ucx",
    )
    parser.add_argument(
        "--batch", type=int, default=0, help="learner batch size (default: about 5 ms of the aggregate stream, 1 to 32)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="limit of one row, seconds (default 120)")
    parser.add_argument("--json", help="write the machine, the arguments and the rows here")
    parser.add_argument("--plot", help="write a PNG of latency p50/p99 and learner CPU against N here")
    args = parser.parse_args(argv)
    try:
        counts = [int(a) for a in args.actors.split(",") if a.strip()]
    except ValueError:
        parser.error(f"--actors takes a comma list of integers, got {args.actors!r}")
    if not counts or min(counts) < 1:
        parser.error("--actors: every count must be >= 1")
    if args.procs < 1 or args.rate <= 0 or args.seconds <= 0 or args.timeout <= 0 or args.batch < 0:
        parser.error("--procs, --rate, --seconds and --timeout must be positive, --batch >= 0")
    transports = _transports(args.transport)
    info = machine()
    print(f"rlink bench --suite scale: {info.get('cpus')} CPUs, python {info['python']}, git {info.get('git', '?')}; "
          f"{args.rate:g} steps/s per actor for {args.seconds:g}s; load average {info['loadavg']}", flush=True)  # fmt: skip
    rows = []
    started = time.monotonic()
    for transport in transports:
        for n in counts:
            row = run_row(transport, n, min(args.procs, n), args.rate, args.seconds, args.timeout, args.batch or None)
            rows.append(row)
            state = (
                f"error: {row['error']}"
                if row["error"]
                else (
                    f"connected {row['connected']}/{n} in {row['connect_s']:.2f}s, delivered {row.get('delivered')}"
                    f"/{row.get('expected')}, p50 {row.get('p50_ms', float('nan')):.2f} ms"
                )
            )
            print(f"[{transport} x{n}] {state} ({row['wall_s']:.1f}s)", flush=True)
    print()
    print_table(rows)
    print(f"\ntotal {time.monotonic() - started:.0f}s; load average at the end {loadavg()}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, fh, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


__all__ = ["main", "run_row"]

if __name__ == "__main__":
    sys.exit(main())

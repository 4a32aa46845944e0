"""Soak at scale: N actors (threads over P processes) into one learner for minutes, a random actor
process SIGKILLed and restarted every ``--kill-every`` seconds, and the learner itself SIGKILLed
and restarted (same port, same token) ``--learner-restarts`` times.

Every actor (slot ``s``, generation ``g``: how often its process was restarted) puts steps
``x = [g, seq]`` and ``t_ns`` (its ``time.time_ns()`` at the put) at ``--rate`` steps/s. The
learner's harness counts, per (slot, generation), in shared memory that outlives a learner: steps
delivered (each seq once), repeats (a seq it already had: a restarted learner was sent again
what its predecessor had fetched; counted, not delivered twice), gaps inside a learner's stream
and the gap at the first step a restarted learner saw of a stream (steps the killed learner
held in its ring, which the actor no longer kept). At the end, per stream:

    put = delivered + reported lost + lost in a kill + lost at the learner restart

where "reported lost" is the actor's own ``steps_lost``, "lost in a kill" what a SIGKILLed
actor process took with it (put, not yet delivered), and a live stream's gaps are exactly what
its actor reported lost. Deduplicated steps (the harness's repeats and the learner's own
``duplicate_steps``) are counted beside. Every ``--sample`` seconds the learner reports its RSS,
open files, threads and the latencies of the steps it fetched; the per-minute table gives
them with the p99 of each minute, and ``--plot`` draws it (matplotlib, when installed).

Usage: python bench/soak.py --actors 512 [--procs 8] [--minutes 60] [--rate 5] [--kill-every 30]
       [--learner-restarts 1] [--transport tcp|shm] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import secrets
import signal
import socket
import sys
import threading
import time

import numpy as np

from bench.soak_report import per_minute, plot, print_report, resource_slopes
from bench.soak_watch import GcPauses, MachineCpu, StallWatch
from rlink_ucx.bench.scale_row import auto_batch  # about 5 ms of the aggregate stream per batch

GENS = 256  # generations (restarts of an actor process) counted per slot
FIELDS = 6  # per (slot, generation): delivered, repeats, gaps, restart gap, next seq, learner that saw it last
DELIVERED, REPEATS, GAPS, RESTART_GAP, NEXT, SEEN_BY = range(FIELDS)
STEP_BYTES = 24  # x: 2 int64, t_ns: int64
RESTART_SETTLES = 30.0  # seconds after a learner restart whose slow samples are the outage's


def counters(shared) -> np.ndarray:
    return np.frombuffer(shared, np.int64).reshape(-1, GENS, FIELDS)


def learner_main(port: int, token: str, transport: str, shared, generation: int, reports, cmd, sample: float,
                 batch_size: int) -> None:  # fmt: skip
    """One learner incarnation: fetch, count each stream into ``shared``, sample resources."""
    from rlink_ucx import Learner, RLinkDataset
    from rlink_ucx import TimeoutError as FetchTimeout

    table = counters(shared)
    with Learner(f"127.0.0.1:{port}", token=token, transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=batch_size)
        single = RLinkDataset(learner, batch_size=1)
        reports.put(("ready", generation, None))
        lat: list[np.ndarray] = []
        last, draining = time.monotonic(), False
        pauses, cpu_at, cpu_then = GcPauses(), sum(os.times()[:2]), time.monotonic()
        while True:
            try:
                msg = cmd.get_nowait()
            except queue.Empty:
                msg = None
            if msg == "pause":  # about to be killed: nothing half counted
                stats = learner.stats()
                reports.put(("paused", generation, {"buffered_bytes": stats["buffer"]["buffered_bytes"],
                                                    "duplicate_steps": stats["total"]["duplicate_steps"]}))  # fmt: skip
                time.sleep(3600)
            if msg == "drain":
                draining = True
            try:
                batch = (single if draining else dataset).fetch(timeout=0.2)
            except FetchTimeout:
                batch = None
            if batch is not None:
                now = time.time_ns()
                fresh = []  # latencies of the steps delivered (not of repeats)
                for actor, (gen, seq), t_ns in zip(batch.actor_id.tolist(), batch["x"].tolist(),
                                                   batch["t_ns"].tolist()):  # fmt: skip
                    row = table[actor - 1, gen]
                    if row[SEEN_BY] != generation + 1:  # the first step this learner sees of the stream
                        if seq > row[NEXT] and generation > 0 and row[SEEN_BY] > 0:
                            row[RESTART_GAP] += seq - row[NEXT]
                            row[NEXT] = seq
                        row[SEEN_BY] = generation + 1
                    if seq < row[NEXT]:
                        row[REPEATS] += 1
                        continue
                    row[GAPS] += seq - row[NEXT]
                    row[NEXT] = seq + 1
                    row[DELIVERED] += 1
                    fresh.append(now - t_ns)
                lat.append(np.array(fresh, np.int64))
            if time.monotonic() - last >= sample:
                last = time.monotonic()
                with open("/proc/self/statm") as f:
                    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                stats = learner.stats()
                latencies = np.concatenate(lat) if lat else np.zeros(0, np.int64)
                lat = []
                cpu_now, now_s = sum(os.times()[:2]), time.monotonic()
                cores = (cpu_now - cpu_at) / max(now_s - cpu_then, 1e-3)  # over the time it really took
                cpu_at, cpu_then = cpu_now, now_s
                reports.put(("sample", generation, {
                    "time": time.time(), "rss_mib": rss / 2**20, "fds": len(os.listdir("/proc/self/fd")),
                    "load": os.getloadavg()[0],  # the machine's: other work on it shows in the p99
                    "threads": len(os.listdir("/proc/self/task")), "lat_ms": (latencies / 1e6).astype(np.float32),
                    "connected": stats.get("connected_actors"), "duplicate_steps": stats["total"]["duplicate_steps"],
                    "learner_cpu": round(cores, 3), **pauses.take(),  # GC since the last sample
                }))  # fmt: skip


def actor_process(port: int, token: str, transport: str, slots: list[int], gen: int, rate: float, puts, stop,
                  results) -> None:  # fmt: skip
    """Actors ``slots`` (threads) of generation ``gen``: put until ``stop``, then flush and report."""
    from rlink_ucx import Actor, Config

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = Config.from_env(reconnect_timeout=120, put_timeout=120, connect_timeout=120)
    out: dict[int, dict] = {}

    def run(slot: int) -> None:
        try:
            with Actor(f"127.0.0.1:{port}", token=token, transport=transport, actor_id=slot + 1, config=config) as a:
                x, t_ns = np.array([gen, 0], np.int64), np.zeros((), np.int64)
                period, due, seq = 1.0 / rate, time.monotonic() + random.random() / rate, 0
                while not stop.value:
                    left = due - time.monotonic()
                    if left > 0:
                        time.sleep(min(left, 0.5))
                        continue
                    x[1], t_ns[()] = seq, time.time_ns()
                    puts[slot] = seq + 1  # counted before the call: a kill may land inside it
                    a.put({"x": x, "t_ns": t_ns})
                    seq += 1
                    due += period
                a.flush(120)
                out[slot] = {"steps_lost": a.stats()["steps_lost"], "error": None}
        except Exception as exc:  # noqa: BLE001 - reported
            out[slot] = {"steps_lost": 0, "error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put((gen, out))


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.rng = random.Random(args.seed)
        self.token = secrets.token_hex(32)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.shared = self.ctx.RawArray("q", args.actors * GENS * FIELDS)
        self.puts = self.ctx.RawArray("q", args.actors)  # of the current generation of each slot
        self.stop = self.ctx.RawValue("b", 0)
        self.reports, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.groups = [list(range(p, args.actors, args.procs)) for p in range(args.procs)]
        self.gen = [0] * args.procs
        self.procs: list = [None] * args.procs
        self.put: dict[tuple[int, int], int] = {}  # (slot, gen) -> steps put, final
        self.killed: set[tuple[int, int]] = set()
        self.samples: list[dict] = []
        self.events: list[tuple[float, str]] = []
        self.learner_gen = 0
        self.learner = None
        self.learner_cmd = None
        self.lost_in_learner_ring_bytes = 0
        self.learner_duplicates = 0  # duplicate_steps of the learners that were killed
        self.started = time.time()
        self.ended = 0.0
        self.machine = MachineCpu()
        self.watch = StallWatch(lambda: self.learner.pid if self.learner is not None else None, args.sample)
        self.first_minute: list[np.ndarray] = []  # latencies of the first minute, for what is slow
        self.slow_ms: float | None = None  # 2x the first minute's p99, once it is known
        self.restarted_at = -1e9

    def start_learner(self) -> None:
        # Queues of its own for each learner: a process SIGKILLed just after its queue's feeder
        # thread wrote a message, but before that thread released the queue's write lock,
        # leaves the lock taken for good (the harness reads "paused" and kills at once), and
        # the next learner's "ready" then never leaves its process.
        self.learner_cmd = self.ctx.Queue()
        self.reports = self.ctx.Queue()
        self.learner = self.ctx.Process(target=learner_main, daemon=True, args=(
            self.port, self.token, self.args.transport, self.shared, self.learner_gen, self.reports, self.learner_cmd,
            self.args.sample, auto_batch(self.args.actors, self.args.rate)))  # fmt: skip
        self.learner.start()
        self.wait_for("ready")

    def wait_for(self, kind: str, timeout: float = 60) -> dict | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                msg = self.reports.get(timeout=1)
            except queue.Empty:
                continue
            if msg[0] == "sample":
                self.take_sample(msg)
            elif msg[0] == kind:
                return msg[2]
        raise TimeoutError(f"the learner did not report {kind!r} within {timeout}s")

    def take_sample(self, msg: tuple) -> None:
        """A learner's sample, with the machine's CPU by whom since the last one; a slow one
        (or none for a while: ``StallWatch``) gets the learner's stacks dumped."""
        sample = {**msg[2], "learner": msg[1]}
        pids = {os.getpid(), *(p.pid for p in [self.learner, *self.procs] if p is not None)}
        sample.update(self.machine.read(pids))
        self.samples.append(sample)
        lat = sample["lat_ms"]
        if self.slow_ms is None:
            if sample["time"] - self.started < 60:
                self.first_minute.append(lat)
            elif self.first_minute and len(first := np.concatenate(self.first_minute)):
                self.slow_ms = 2 * float(np.percentile(first, 99))
        # Steps put while a learner restarted wait for the next one: slow, and known why.
        after_restart = time.monotonic() - self.restarted_at < RESTART_SETTLES
        self.watch.sample(float(np.percentile(lat, 99)) if len(lat) else None, None if after_restart else self.slow_ms)

    def start_actors(self, p: int) -> None:
        for slot in self.groups[p]:
            self.puts[slot] = 0
        self.procs[p] = self.ctx.Process(target=actor_process, daemon=True, args=(
            self.port, self.token, self.args.transport, self.groups[p], self.gen[p], self.args.rate, self.puts,
            self.stop, self.results))  # fmt: skip
        self.procs[p].start()

    def kill_actors(self, p: int) -> None:
        if self.procs[p].exitcode is not None:  # ended by itself: its actors' errors are in its results
            self.event(f"actor process {p} had ended by itself (exit code {self.procs[p].exitcode})")
        else:
            os.kill(self.procs[p].pid, signal.SIGKILL)
        self.procs[p].join(10)
        for slot in self.groups[p]:
            self.put[(slot, self.gen[p])] = self.puts[slot]
            self.killed.add((slot, self.gen[p]))
        self.gen[p] += 1
        if self.gen[p] >= GENS:
            raise RuntimeError(f"more than {GENS} restarts of one actor process: raise --kill-every")
        self.start_actors(p)

    def restart_learner(self) -> None:
        assert self.learner is not None and self.learner_cmd is not None
        self.watch.paused = True  # no samples until the next learner is up
        self.learner_cmd.put("pause")
        paused = self.wait_for("paused")
        assert paused is not None
        self.lost_in_learner_ring_bytes += paused["buffered_bytes"]
        self.learner_duplicates += paused["duplicate_steps"]
        os.kill(self.learner.pid, signal.SIGKILL)
        self.learner.join(10)
        self.learner_gen += 1
        self.start_learner()
        self.watch.last_sample, self.watch.paused = time.monotonic(), False
        self.restarted_at = time.monotonic()

    def event(self, what: str) -> None:
        t = time.time() - self.started
        self.events.append((round(t, 1), what))
        print(f"[soak] {t:7.1f}s {what}", flush=True)

    def run(self) -> dict:
        a = self.args
        self.start_learner()
        for p in range(a.procs):
            self.start_actors(p)
        self.started = self.watch.started = time.time()
        self.watch.last_sample = time.monotonic()
        self.watch.start()
        end = self.started + a.minutes * 60
        restarts = [self.started + (i + 1) * a.minutes * 60 / (a.learner_restarts + 1)
                    for i in range(a.learner_restarts)]  # fmt: skip
        next_kill = self.started + a.kill_every
        while time.time() < end:
            self.drain_reports(min(next_kill, end, *restarts) - time.time())
            now = time.time()
            if restarts and now >= restarts[0]:
                restarts.pop(0)
                self.restart_learner()
                self.event(f"learner killed and restarted (generation {self.learner_gen})")
            if now >= next_kill and now < end:
                next_kill += a.kill_every
                p = self.rng.randrange(a.procs)
                self.kill_actors(p)
                self.event(f"actor process {p} killed ({len(self.groups[p])} actors), restarted as generation "
                           f"{self.gen[p]}")  # fmt: skip
        return self.finish()

    def drain_reports(self, seconds: float) -> None:
        end = time.monotonic() + max(0.0, seconds)
        while True:
            try:
                msg = self.reports.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                return
            if msg[0] == "sample":
                self.take_sample(msg)
            if time.monotonic() >= end:
                return

    def finish(self) -> dict:
        a = self.args
        self.ended = time.time()
        self.watch.paused = True  # the drain below is the harness's, not the stream's
        self.watch.close()
        self.stop.value = 1
        finals: dict[tuple[int, int], dict] = {}
        while not all((self.groups[p][0], self.gen[p]) in finals for p in range(a.procs)):
            gen, out = self.results.get(timeout=300)  # (and those of a process that ended by itself)
            for slot, value in out.items():
                finals[(slot, gen)] = value
        for p in range(a.procs):
            self.procs[p].join(30)
            for slot in self.groups[p]:
                self.put[(slot, self.gen[p])] = self.puts[slot]
        assert self.learner_cmd is not None and self.learner is not None
        self.learner_cmd.put("drain")
        table = counters(self.shared)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until every live stream is in (or a minute passed)
            self.drain_reports(1.0)
            if all(table[s, g, DELIVERED] + table[s, g, GAPS] + table[s, g, RESTART_GAP] >= self.put[(s, g)]
                   for (s, g) in finals):  # fmt: skip
                break
        self.learner_cmd.put("pause")
        paused = self.wait_for("paused")
        assert paused is not None
        os.kill(self.learner.pid, signal.SIGKILL)
        self.learner.join(10)
        return self.account(table, finals, paused["duplicate_steps"])

    def account(self, table: np.ndarray, finals: dict, last_duplicates: int) -> dict:
        rows = []
        for (slot, gen), put in sorted(self.put.items()):
            c = table[slot, gen]
            missing = put - int(c[DELIVERED])
            killed = (slot, gen) in self.killed
            if killed:  # it reports nothing: what is missing beyond the restart's gap went with it
                reported, lost_at_restart = 0, int(c[RESTART_GAP])
                lost_in_kill = missing - lost_at_restart
                balanced = lost_in_kill >= 0 and c[GAPS] <= lost_in_kill
            else:  # every gap is accounted for: what its actor reported lost, or the killed learner's ring
                reported = finals.get((slot, gen), {}).get("steps_lost", 0)
                lost_in_kill, lost_at_restart = 0, int(c[GAPS] + c[RESTART_GAP]) - reported
                balanced = missing == c[GAPS] + c[RESTART_GAP] and c[GAPS] <= reported and lost_at_restart >= 0
            rows.append({"stream": f"{slot + 1}/{gen}", "put": put, "delivered": int(c[DELIVERED]),
                         "repeats": int(c[REPEATS]), "gaps": int(c[GAPS]), "reported_lost": reported,
                         "lost_in_kill": lost_in_kill, "lost_at_learner_restart": lost_at_restart,
                         "killed": killed, "balanced": bool(balanced)})  # fmt: skip
        errors = sorted({v["error"] for v in finals.values() if v["error"]})
        totals = {k: int(sum(r[k] for r in rows)) for k in ("put", "delivered", "repeats", "reported_lost",
                                                             "lost_in_kill", "lost_at_learner_restart")}  # fmt: skip
        totals["learner_duplicates"] = self.learner_duplicates + last_duplicates
        window = min(self.ended, self.started + self.args.minutes * 60)  # the drain after it is the harness's
        minutes = per_minute([x for x in self.samples if x["time"] < window], self.started, self.events)
        flat = resource_slopes(minutes)
        out = {"args": vars(self.args), "events": self.events, "totals": totals, "minutes": minutes,
               "unbalanced": [r for r in rows if not r["balanced"]][:50], "streams": len(rows),
               "actor_errors": errors, "lost_in_learner_ring_bytes": self.lost_in_learner_ring_bytes,
               "slopes": flat, "captures": self.watch.captures}  # fmt: skip
        # What restarts lost beyond what actors reported was in the killed learners' rings.
        out["restart_loss_within_rings"] = (
            totals["lost_at_learner_restart"] * STEP_BYTES <= self.lost_in_learner_ring_bytes
        )
        out["ok"] = not out["unbalanced"] and not errors and out["restart_loss_within_rings"]
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actors", type=int, required=True)
    parser.add_argument("--procs", type=int, default=8, help="actor processes (default 8)")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=5.0, help="steps per second per actor (default 5)")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between actor process kills")
    parser.add_argument("--learner-restarts", type=int, default=1)
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between learner samples")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "shm", "ucx"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    if args.actors < 1 or not 1 <= args.procs <= args.actors or args.rate <= 0 or args.kill_every <= 0:
        parser.error("--actors >= --procs >= 1, --rate and --kill-every > 0")
    soak = Soak(args)
    try:
        out = soak.run()
    finally:
        soak.watch.close()
        soak.stop.value = 1
        for p in [*soak.procs, soak.learner]:
            if p is not None and p.is_alive():
                p.kill()
    print_report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.plot:
        plot(out, args.plot)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

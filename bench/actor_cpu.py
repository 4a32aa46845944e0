"""The CPU cost of one connected actor: idle, or putting small steps at a low rate.

Each run starts a learner in its own (spawned) process, with a thread that fetches every step,
then an actor process that connects, puts one step and flushes (the schema is negotiated), lets
the connection settle, and then, for ``--seconds``, either idles (``--rate 0``) or puts
CartPole-sized steps (obs float32[4], action int64, reward float32, done bool) at ``--rate``
steps/s. Only that window is measured, in the actor process: CPU (% of one core, all its
threads, ``time.process_time``), voluntary context switches (wake-ups after sleeping,
``getrusage``; the rlink I/O thread's own count from ``/proc``), and the time spent in ``put``.
The learner checks that every step arrived. Runs alternate over transports and rates; the
report gives the median of the repetitions and every value.

With ``--actors N`` the actor process holds N actors (the scale benchmark's 64 a process),
each putting at ``--rate``, driven by a thread each (``--drive threads``: all at the same
instants, as the scale benchmark's lockstep) or by one thread for all (``--drive loop``: a
process stepping a vector of environments); ``us/put`` is the process's CPU per put.

Usage: python bench/actor_cpu.py [--transport tcp,shm] [--rate 0,10,100] [--seconds 10]
       [--reps 3] [--actors 1] [--drive threads,loop] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

IO_THREAD = "rlink-actor-io"  # the name of the actor process's shared I/O thread


def _learner(transport: str, ready: Any, stop: Any, out: Any) -> None:
    from rlink_ucx import Learner, RLinkDataset
    from rlink_ucx import TimeoutError as FetchTimeout

    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        got = 0
        done = threading.Event()

        def consume() -> None:  # a consumer that keeps up: fetch blocks until a step comes
            nonlocal got
            while not done.is_set():
                try:
                    got += len(dataset.fetch(timeout=0.5)["reward"])
                except FetchTimeout:
                    pass

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        ready.put(learner.address)
        stop.wait(600)
        time.sleep(0.3)  # the last steps' fetch
        done.set()
        consumer.join(2)
        out.put(got)


def _thread_switches(name: str) -> int | None:
    """Voluntary context switches of this process's thread called ``name`` (Linux)."""
    tid = next((t.native_id for t in threading.enumerate() if t.name == name), None)
    try:
        with open(f"/proc/self/task/{tid}/status") as fh:
            for line in fh:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _sample() -> dict[str, Any]:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return {"wall": time.monotonic(), "cpu": time.process_time(), "vcsw": ru.ru_nvcsw, "ivcsw": ru.ru_nivcsw,
            "io_vcsw": _thread_switches(IO_THREAD)}  # fmt: skip


def _put_at_rate(actor: Any, step: dict[str, Any], rate: float, n: int, t0: float, in_put: list[float]) -> None:
    """``n`` puts to ``actor``, one every ``1 / rate`` s from ``t0`` on (all actors' at the same instants)."""
    for i in range(n):
        left = t0 + i / rate - time.monotonic()
        if left > 0:
            time.sleep(left)
        a = time.perf_counter()
        actor.put(step)
        in_put.append(time.perf_counter() - a)


def _put_round_robin(actors: list[Any], step: dict[str, Any], rate: float, n: int, t0: float,
                     in_put: list[float]) -> None:  # fmt: skip
    """``n`` rounds of one put to each of ``actors`` from one thread, a round every ``1 / rate`` s
    (a process stepping a vector of environments, one actor each)."""
    for i in range(n):
        left = t0 + i / rate - time.monotonic()
        if left > 0:
            time.sleep(left)
        for actor in actors:
            a = time.perf_counter()
            actor.put(step)
            in_put.append(time.perf_counter() - a)


def _actor(address: str, transport: str, rate: float, seconds: float, settle: float, out: Any, count: int = 1,
           drive: str = "threads") -> None:  # fmt: skip
    """``count`` actors in this process; with more than one, ``drive`` says who puts: a thread
    each (``threads``, every actor at the same instants), or one thread for all (``loop``)."""
    from rlink_ucx import Actor

    obs = np.zeros(4, np.float32)
    step = {"obs": obs, "action": 0, "reward": 1.0, "done": False}
    actors = [Actor(address, transport=transport) for _ in range(count)]
    try:
        for actor in actors:
            actor.put(step)
        for actor in actors:
            actor.flush(30)
        if os.environ.get("ACTOR_CPU_PID"):  # for strace / py-spy: where to attach
            print(f"actor pid {os.getpid()}", file=sys.stderr, flush=True)
        time.sleep(settle)  # connecting and the first frame are not what is measured
        frames = sum(a.stats()["frames_sent"] for a in actors)
        before = _sample()
        in_put: list[float] = []
        if rate <= 0:
            time.sleep(seconds)
        else:
            n, t0 = int(seconds * rate), time.monotonic() + 0.05
            if count == 1 or drive == "loop":
                _put_round_robin(actors, step, rate, n, t0, in_put)
            else:
                threads = [threading.Thread(target=_put_at_rate, args=(a, step, rate, n, t0, in_put)) for a in actors]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            left = t0 + seconds - time.monotonic()
            if left > 0:
                time.sleep(left)
        after = _sample()
        stats = [a.stats() for a in actors]
        for actor in actors:
            actor.flush(30)  # after the window: what was put must arrive
    finally:
        for actor in actors:
            actor.close()
    wall = after["wall"] - before["wall"]
    io = None if before["io_vcsw"] is None or after["io_vcsw"] is None else after["io_vcsw"] - before["io_vcsw"]
    cpu = after["cpu"] - before["cpu"]
    out.put({
        "cpu_pct": 100 * cpu / wall,
        "cpu_us_per_put": 1e6 * cpu / len(in_put) if in_put else None,
        "wakeups_per_s": (after["vcsw"] - before["vcsw"]) / wall,
        "io_thread_wakeups_per_s": None if io is None else io / wall,
        "involuntary_per_s": (after["ivcsw"] - before["ivcsw"]) / wall,
        "put_us_median": 1e6 * statistics.median(in_put) if in_put else None,
        "put_us_max": 1e6 * max(in_put) if in_put else None,
        "puts": len(in_put), "frames_sent": sum(x["frames_sent"] for x in stats) - frames,
        "steps_put": sum(x["steps_put"] for x in stats), "transport": stats[0]["transport"], "wall_s": wall,
    })  # fmt: skip


def median_or_none(values: list[Any]) -> float | None:
    return None if values[0] is None else statistics.median(values)


def run_once(transport: str, rate: float, seconds: float, settle: float, count: int = 1,
             drive: str = "threads") -> dict[str, Any]:  # fmt: skip
    """One learner process, one actor process; the actor's measurements and the steps the
    learner received (which must be every step put)."""
    ctx = mp.get_context("spawn")
    ready, out, learner_out, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    learner = ctx.Process(target=_learner, args=(transport, ready, stop, learner_out), daemon=True)
    learner.start()
    try:
        address = ready.get(timeout=60)
        actor = ctx.Process(target=_actor, args=(address, transport, rate, seconds, settle, out, count, drive),
                            daemon=True)  # fmt: skip
        actor.start()
        deadline = time.monotonic() + seconds + settle + 120
        while True:
            try:
                result = out.get(timeout=1.0)
                break
            except queue.Empty:
                if not actor.is_alive() or time.monotonic() > deadline:
                    actor.kill()
                    raise RuntimeError(f"the actor process failed (exit code {actor.exitcode})") from None
        actor.join(30)
        stop.set()
        result["received"] = learner_out.get(timeout=30)
        learner.join(30)
    finally:
        stop.set()
        for proc in (learner,):
            if proc.is_alive():
                proc.kill()
    result["lost"] = result["steps_put"] - result["received"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", default="tcp,shm", help="comma-separated: tcp, shm, ucx")
    parser.add_argument("--rate", default="0,10,100", help="comma-separated steps/s (0: idle)")
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the first flush, not measured")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--actors", type=int, default=1, help="actors in the actor process")
    parser.add_argument("--drive", default="threads", help="comma-separated, with --actors > 1: threads (one "
                        "thread per actor, all putting at the same instants), loop (one thread puts to every actor)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    transports = args.transport.split(",")
    rates = [float(r) for r in args.rate.split(",")]
    drives = args.drive.split(",") if args.actors > 1 else ["threads"]
    keys = [(t, r, d) for t in transports for r in rates for d in drives]
    runs: dict[tuple[str, float, str], list[dict[str, Any]]] = {key: [] for key in keys}
    for _ in range(args.reps):  # alternate: a slow spell of the machine hits every row alike
        for t, r, d in keys:
            runs[(t, r, d)].append(run_once(t, r, args.seconds, args.settle, args.actors, d))
    rows = []
    print(f"{args.actors} actor(s) in the actor process")
    print(f"{'transport':<10}{'rate':>6}{'drive':>8}{'cpu %':>8}{'us/put':>8}{'wakeups/s':>11}{'io wakeups/s':>14}"
          f"{'put us':>9}{'frames':>8}{'lost':>6}   cpu % of each run")  # fmt: skip
    for (t, r, d), results in runs.items():
        med = lambda key, results=results: median_or_none([x[key] for x in results])
        row = {"transport": t, "rate": r, "actors": args.actors, "drive": d, "seconds": args.seconds,
               "cpu_pct": med("cpu_pct"), "cpu_us_per_put": med("cpu_us_per_put"),
               "wakeups_per_s": med("wakeups_per_s"), "io_thread_wakeups_per_s": med("io_thread_wakeups_per_s"),
               "put_us_median": med("put_us_median"), "frames_sent": med("frames_sent"),
               "lost": max(x["lost"] for x in results), "runs": results}  # fmt: skip
        rows.append(row)
        each = " ".join(f"{x['cpu_pct']:.3f}" for x in results)
        put_us = "-" if row["put_us_median"] is None else f"{row['put_us_median']:.1f}"
        per_put = "-" if row["cpu_us_per_put"] is None else f"{row['cpu_us_per_put']:.1f}"
        io = "-" if row["io_thread_wakeups_per_s"] is None else f"{row['io_thread_wakeups_per_s']:.1f}"
        print(f"{t:<10}{r:>6g}{d:>8}{row['cpu_pct']:>8.3f}{per_put:>8}{row['wakeups_per_s']:>11.1f}{io:>14}"
              f"{put_us:>9}{row['frames_sent']:>8g}{row['lost']:>6}   {each}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
            json.dump({"machine": machine, "rows": rows}, fh, indent=1)
    return 1 if any(row["lost"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Ingest with one learner and with N learner ranks (``Learner(distributed=True)``), same actors.

Actors know only rank 0's address; each puts Atari-sized steps (a 28,224-byte uint8 frame,
84x84x4) in chunks of 32 as fast as it can. Each learner rank fetches batches of 256 from its
RLinkDataset as fast as it can. After the warm-up, every rank counts the bytes it fetched and
the CPU time its process used over the same window: the aggregate ingest (GB/s, all ranks
together) and each rank's CPU seconds per GB are reported, and the ratio of N ranks to one.
Runs alternate (1, N, 1, N, ...) so drifting load on a shared machine hits both alike.

    python bench/many_learners.py [--ranks 2] [--actors 4] [--seconds 8] [--repeats 2]
                                  [--transport shm|tcp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OBS = (84, 84, 4)
CHUNK, BATCH = 32, 256


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, world: int, master_port: int, transport: str, window, address_q, out_q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
                      OMP_NUM_THREADS="1")  # fmt: skip
    from rlink_ucx import Learner, RLinkDataset
    from rlink_ucx import TimeoutError as RLinkTimeout

    with Learner("127.0.0.1:0", transport=transport, distributed=world > 1) as learner:
        if rank == 0:
            address_q.put(learner.address)
        dataset = RLinkDataset(learner, batch_size=BATCH)
        counted = fetched = 0
        cpu0 = None
        while True:
            try:
                batch = dataset.fetch(timeout=1.0)
            except RLinkTimeout:
                batch = None
            now = time.time()
            start, end = window[0], window[1]
            if start and now >= start and cpu0 is None:
                cpu0, counted = time.process_time(), 0
            if batch is not None:
                fetched += len(batch.seq)
                if cpu0 is not None and now < end:
                    counted += len(batch.seq) * batch["obs"][0].numel()
            if end and now >= end:
                break
        cpu = time.process_time() - (cpu0 or 0.0)
        out_q.put({"rank": rank, "bytes": counted, "cpu": cpu, "seconds": end - start, "fetched": fetched})
        # stay until every rank measured: a rank closing first would move its actors mid-window
        time.sleep(1.0)


def actor_main(address_q, ready_q, stop) -> None:
    import numpy as np

    from rlink_ucx import Actor

    address = address_q.get()
    address_q.put(address)  # for the next actor
    obs = np.random.default_rng().integers(0, 255, (CHUNK, *OBS), dtype=np.uint8)
    with Actor(address) as actor:
        actor.put_many({"obs": obs})
        actor.flush(timeout=60)
        ready_q.put(1)
        while not stop.is_set():
            actor.put_many({"obs": obs})
        actor.flush(timeout=30)


def one_run(world: int, actors: int, seconds: float, transport: str, warmup: float = 1.0) -> dict:
    ctx = mp.get_context("spawn")
    window = ctx.Array("d", [0.0, 0.0])
    address_q, ready_q, out_q, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    port = _free_port()
    ranks = [ctx.Process(target=rank_main, args=(r, world, port, transport, window, address_q, out_q))
             for r in range(world)]  # fmt: skip
    for p in ranks:
        p.start()
    procs = [ctx.Process(target=actor_main, args=(address_q, ready_q, stop)) for _ in range(actors)]
    for p in procs:
        p.start()
    try:
        for _ in range(actors):  # every actor streams (at its rank) before the window opens
            ready_q.get(timeout=120)
        start = time.time() + warmup
        window[0], window[1] = start, start + seconds
        rows = [out_q.get(timeout=seconds + warmup + 120) for _ in range(world)]
    finally:
        stop.set()
        for p in [*procs, *ranks]:
            p.join(30)
            if p.is_alive():
                p.kill()
    total = sum(r["bytes"] for r in rows)
    return {"ranks": world, "actors": actors, "transport": transport, "gb_per_s": total / seconds / 1e9,
            "per_rank": [{"rank": r["rank"], "gb_per_s": r["bytes"] / seconds / 1e9,
                          "cpu_s_per_gb": r["cpu"] / (r["bytes"] / 1e9) if r["bytes"] else None}
                         for r in sorted(rows, key=lambda r: r["rank"])]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--actors", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--transport", default="shm")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs: dict[int, list[dict]] = {1: [], args.ranks: []}
    for _ in range(args.repeats):
        for world in (1, args.ranks):
            run = one_run(world, args.actors, args.seconds, args.transport)
            runs[world].append(run)
            cpu = ", ".join(f"rank {r['rank']}: {r['gb_per_s']:.2f} GB/s, {r['cpu_s_per_gb'] or 0:.2f} CPU s/GB"
                            for r in run["per_rank"])  # fmt: skip
            print(f"{world} rank(s), {args.actors} actors, {args.transport}: {run['gb_per_s']:.2f} GB/s ({cpu})",
                  flush=True)  # fmt: skip
    one = statistics.median(r["gb_per_s"] for r in runs[1])
    many = statistics.median(r["gb_per_s"] for r in runs[args.ranks])
    print(f"median: 1 rank {one:.2f} GB/s, {args.ranks} ranks {many:.2f} GB/s: ratio {many / one:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": runs, "one": one, "many": many, "ratio": many / one}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

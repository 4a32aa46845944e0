"""Large steps on the shm plane: direct reads vs the ring, and first-touch cost of fresh memory.

    python bench/large_steps.py [--sizes 1,4,16] [--actors 1,4] [--seconds 4] [--reps 2]

For each step size (MiB) and actor count it streams random steps (``put`` of one uint8 array
plus an int64 stamp) from actor processes into a learner (``RLinkDataset``, batches of one
step) for ``--seconds``, once with direct reads (``Config.shm_direct_read``) and once without,
alternating, and prints the median GB/s at the learner. It starts with one line on the cost
of first touches on this machine (fresh anonymous memory vs the same memory warm), the reason
rlink populates its buffers ahead of use (rlink_ucx/_memory.py).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time

import numpy as np


def first_touch(nbytes: int = 256 << 20) -> tuple[float, float]:
    """GiB/s writing fresh anonymous memory, then the same memory again."""
    mm = mmap.mmap(-1, nbytes)
    a = np.frombuffer(mm, np.uint8)
    t = time.perf_counter()
    a[:] = 1
    fresh = time.perf_counter() - t
    t = time.perf_counter()
    a[:] = 2
    warm = time.perf_counter() - t
    del a
    mm.close()
    return nbytes / fresh / 2**30, nbytes / warm / 2**30


def _actor(address: str, size: int, seconds: float, go) -> None:
    from rlink_ucx import Actor

    x = np.random.default_rng(os.getpid()).integers(0, 255, size, dtype=np.uint8)
    t = np.zeros((), np.int64)
    with Actor(address, transport="shm") as actor:
        go.wait(60)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            actor.put({"t": t, "x": x})
        actor.flush(60)


def stream(size: int, actors: int, seconds: float, direct: bool) -> float:
    """GB/s received over the middle of the stream (the first and last 10% dropped)."""
    from rlink_ucx import Config, Learner, RLinkDataset
    from rlink_ucx import TimeoutError as FetchTimeout

    os.environ["RLINK_SHM_DIRECT_READ"] = "1" if direct else "0"  # the actors' config
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    config = Config(buffer_bytes=max(64 << 20, 16 * size), max_frame_bytes=max(64 << 20, 2 * size))
    with Learner("127.0.0.1:0", transport="shm", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        procs = [ctx.Process(target=_actor, args=(learner.address, size, seconds, go)) for _ in range(actors)]
        for p in procs:
            p.start()
        while learner.stats()["connected_actors"] < actors:
            time.sleep(0.05)
        go.set()
        arrivals = []
        try:
            while True:
                dataset.fetch(timeout=3)
                arrivals.append(time.monotonic())
        except FetchTimeout:
            pass
        for p in procs:
            p.join(30)
    lo, hi = int(len(arrivals) * 0.1), int(len(arrivals) * 0.9)
    if hi - lo < 2:
        raise RuntimeError(f"only {len(arrivals)} steps arrived")
    return (hi - lo) * size / (arrivals[hi] - arrivals[lo]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4,16", help="step sizes in MiB (below 4 MiB both runs use the ring)")
    parser.add_argument("--actors", default="1,4")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    fresh, warm = first_touch()
    print(f"first touch: {fresh:.2f} GiB/s into fresh memory, {warm:.2f} GiB/s into the same memory warm")
    print(f"{'step':>6} {'actors':>6} {'direct GB/s':>12} {'ring GB/s':>10}")
    for mib in (int(s) for s in args.sizes.split(",")):
        for n in (int(a) for a in args.actors.split(",")):
            runs: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.reps):
                for direct in (True, False):
                    runs[direct].append(stream(mib << 20, n, args.seconds, direct))
            d, r = statistics.median(runs[True]), statistics.median(runs[False])
            print(f"{mib:>4}Mi {n:>6} {d:>12.2f} {r:>10.2f}", flush=True)


if __name__ == "__main__":
    main()

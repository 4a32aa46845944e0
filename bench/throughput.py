"""Actor -> learner throughput against a raw-socket baseline, measured in one run.

Every row is measured at the receiver, in two processes (spawn), after skipping the first 5%
of the messages or batches (the same share for every system). The repetitions of the
baseline and of the rlink planes alternate; each row is the median of its repetitions:

- ``raw-socket``: ``sendall`` of each message / ``recv_into`` a preallocated buffer;
- ``rlink-tcp`` / ``rlink-ucx`` / ``rlink-shm``: ``Actor.put`` of one ``uint8[size]`` step per message ->
  ``RLinkDataset.fetch`` (batches of about 4 MiB);
- ``cartpole-put`` / ``cartpole-put_many``: CartPole-sized steps (obs float32[4], action int64,
  reward float32, done bool), one ``put`` per step, or ``put_many`` chunks of 64 steps (``--chunk``).

Usage: python bench/throughput.py [--sizes 1K,64K,1M,16M] [--reps 3] [--json out.json]
       [--device cuda:0]  (CUDA steps from the actor, batches on the GPU; the raw socket stays on the host)
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlink_ucx.bench.common import BATCH_BYTES, installed, recv_exact

SIZES = {"1K": 1 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20}
TOTAL_BYTES = {1 << 10: 48 << 20, 64 << 10: 768 << 20, 1 << 20: 1536 << 20, 16 << 20: 2048 << 20}


# --- raw socket baseline ---------------------------------------------------------------------
def _raw_sender(port: int, size: int, count: int, congestion: str | None) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    payload = np.random.randint(0, 255, size, dtype=np.uint8)
    view = payload.data
    for _ in range(count):
        sock.sendall(view)
    sock.recv(1)  # wait for the receiver to finish before closing
    sock.close()


def raw_socket(size: int, count: int, congestion: str | None = None) -> float:
    """Bytes/s of ``sendall`` -> ``recv_into`` between two processes; ``congestion`` sets the
    sender's TCP congestion control (None: the system's default)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_raw_sender, args=(port, size, count, congestion))
    proc.start()
    conn, _ = server.accept()
    buf = bytearray(size)
    view = memoryview(buf)

    def recv_message() -> None:
        recv_exact(conn, view)

    warm = max(1, count // 20)
    for _ in range(warm):
        recv_message()
    t0 = time.perf_counter()
    for _ in range(count - warm):
        recv_message()
    elapsed = time.perf_counter() - t0
    conn.send(b"x")
    proc.join(30)
    conn.close()
    server.close()
    return (count - warm) * size / elapsed


def print_medians(runs: dict[str, list[float]], baseline: str) -> None:
    """One line per system of an alternating A/B: median GB/s, its ratio to ``baseline``'s
    median, and every round's value."""
    base = statistics.median(runs[baseline])
    width = max(map(len, runs)) + 1
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"{name:<{width}} {med:6.2f} GB/s  {med / base:5.2f}x   {' '.join(f'{x:.2f}' for x in values)}")


# --- rlink ----------------------------------------------------------------------------------------
def _rlink_actor(address: str, transport: str, kind: str, size: int, count: int, device: str = "cpu",
                 chunk: int = 64) -> None:  # fmt: skip
    from rlink_ucx import Actor

    with Actor(address, transport=transport) as actor:
        if kind == "bytes":
            step: dict[str, Any] = {"x": np.random.randint(0, 255, size, dtype=np.uint8)}
            if device != "cpu":  # the actor's steps live on the GPU too
                import torch

                step = {"x": torch.from_numpy(step["x"]).to(device)}
            for _ in range(count):
                actor.put(step)
        elif kind == "cartpole-put":
            obs = np.zeros(4, np.float32)
            for i in range(count):
                actor.put({"obs": obs, "action": i, "reward": 1.0, "done": False})
        else:  # cartpole-put_many: a vectorized env's `chunk` sub-envs at once
            steps: dict[str, np.ndarray] = {
                "obs": np.zeros((chunk, 4), np.float32),
                "action": np.zeros(chunk, np.int64),
                "reward": np.ones(chunk, np.float32),
                "done": np.zeros(chunk, bool),
            }
            for _ in range(count // chunk):
                actor.put_many(steps)
            if count % chunk:  # the learner waits for exactly `count` steps
                actor.put_many({name: value[: count % chunk] for name, value in steps.items()})
        actor.flush(120)


def rlink(transport: str, kind: str, size: int, count: int, step_bytes: int, device: str = "cpu",
          chunk: int = 64) -> float:  # fmt: skip
    """Returns bytes/s (kind == "bytes") or steps/s, measured at the learner. ``device``: where
    the actor's steps and the learner's batches live ("cuda:0": both on the GPU)."""
    from rlink_ucx import Learner, RLinkDataset

    with Learner("127.0.0.1:0", transport=transport) as learner:
        batch = max(1, BATCH_BYTES // step_bytes) if kind == "bytes" else 16384
        batch = min(batch, count // 4)
        dataset = RLinkDataset(learner, batch_size=batch, device=device)
        args = (learner.address, transport, kind, size, count, device, chunk)
        proc = mp.get_context("spawn").Process(target=_rlink_actor, args=args)
        proc.start()
        batches = count // batch
        warm = max(1, batches // 20)  # the same 5% warm-up the raw-socket baseline skips
        for _ in range(warm):
            dataset.fetch(timeout=120)
        t0 = time.perf_counter()
        for _ in range(batches - warm):
            dataset.fetch(timeout=120)
        elapsed = time.perf_counter() - t0
        proc.join(60)
        if proc.exitcode != 0:
            raise RuntimeError(f"actor process exited with {proc.exitcode}")
        moved = (batches - warm) * batch
        return moved * (step_bytes if kind == "bytes" else 1) / elapsed


def median_of(fn: Callable[[], float], reps: int) -> tuple[float, float, float]:
    values = [fn() for _ in range(reps)]
    return statistics.median(values), min(values), max(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1K,64K,1M,16M")
    parser.add_argument("--transports", default="tcp,ucx,shm")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400_000, help="CartPole steps per repetition")
    parser.add_argument("--chunk", type=int, default=64, help="CartPole steps per put_many")
    parser.add_argument("--kinds", default="cartpole-put,cartpole-put_many",
                        help='CartPole rows to run ("" for none)')
    parser.add_argument("--device", default="cpu",
                        help='where the bytes rows\' steps and batches live: "cpu", or "cuda:0" (CUDA steps, batches on the GPU)')
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    from rlink_ucx.transport.shm import channel as shm
    transports = [t for t in args.transports.split(",") if (t != "ucx" or installed("ucxx")) and (t != "shm" or shm.available())]
    rows = []
    print(f"{'workload':<22}{'system':<16}{'median':>12}{'min':>10}{'max':>10}{'vs raw':>9}")
    for label in filter(None, args.sizes.split(",")):  # --sizes "": no bytes rows
        size = SIZES[label]
        count = TOTAL_BYTES[size] // size
        # Repetitions of the baseline and of each plane alternate, so a slow spell of this
        # (shared, noisy) machine hits them alike instead of one system's whole series.
        runs: dict[str, list[float]] = {"raw-socket": [], **{f"rlink-{t}": [] for t in transports}}
        for _ in range(args.reps):
            runs["raw-socket"].append(raw_socket(size, count))
            for transport in transports:
                runs[f"rlink-{transport}"].append(rlink(transport, "bytes", size, count, size, args.device))
        base = statistics.median(runs["raw-socket"])
        for system, values in runs.items():
            med, ratio = statistics.median(values), statistics.median(values) / base
            rows.append({"workload": f"bytes-{label}", "system": system, "unit": "GB/s",
                         "median": med / 1e9, "min": min(values) / 1e9, "max": max(values) / 1e9, "ratio": ratio})
            print(f"{'bytes-' + label:<22}{system:<16}{med / 1e9:>10.2f}GB{min(values) / 1e9:>10.2f}{max(values) / 1e9:>10.2f}{ratio:>9.2f}")
        sys.stdout.flush()
    for kind in filter(None, args.kinds.split(",")):
        for transport in transports:
            res = median_of(functools.partial(rlink, transport, kind, 0, args.steps, 29, chunk=args.chunk), args.reps)
            rows.append({"workload": kind, "chunk": args.chunk if kind == "cartpole-put_many" else 1,
                         "system": f"rlink-{transport}", "unit": "steps/s",
                         "median": res[0], "min": res[1], "max": res[2], "ratio": None})
            print(f"{kind:<22}{'rlink-' + transport:<16}{res[0]:>12,.0f}{res[1]:>10,.0f}{res[2]:>10,.0f}   steps/s")
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "device": args.device},
                       "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Put -> fetch latency of CUDA steps, per data plane, through the public API only.

One actor process (spawn) puts chunks of ``--chunk`` steps whose ``obs`` tensors live on
``--device`` and whose ``t_ns`` field (int64) is the time of the ``put`` (CLOCK_MONOTONIC, shared by
every process of a host). It flushes after each chunk, so each chunk travels alone (no queueing
behind the previous one). The learner fetches batches of ``--chunk`` steps on ``--device``
and, once a batch is usable (after a CUDA synchronize), records ``now - t_ns`` for each step:
the put -> fetch latency. The first ``--warmup`` chunks are stamped -1 and not counted.

Then the actor puts ``--ready`` more chunks and flushes them; once the learner holds them all,
each ``fetch`` is timed alone: a batch that is already there should come back without waiting
on I/O (only the gather and, on CUDA, the copy to the device).

Usage: python bench/gpu_latency.py [--device cuda:0] [--transport tcp,ucx,shm] [--chunks 300]
       [--chunk 64] [--obs-bytes 4096] [--json out.json]
Exit status: 0 measured (planes that cannot run here are listed as skipped); 3 no CUDA device
for a cuda device; 1 a plane failed. The JSON is written in every case.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

EXIT_NO_CUDA = 3


def _actor(address: str, transport: str, device: str, args: dict[str, int], reports: Any, held: Any) -> None:
    from rlink_ucx import Actor

    try:
        chunk = args["chunk"]
        obs = np.random.rand(chunk, max(1, args["obs_bytes"] // 4)).astype(np.float32)
        if device != "cpu":
            import torch

            obs = torch.from_numpy(obs).to(device)
        with Actor(address, transport=transport) as actor:
            for i in range(args["warmup"] + args["chunks"]):
                stamp = -1 if i < args["warmup"] else time.monotonic_ns()
                actor.put_many({"t_ns": np.full(chunk, stamp, np.int64), "obs": obs})
                actor.flush(args["timeout"])
            for _ in range(args["ready"]):
                actor.put_many({"t_ns": np.full(chunk, -1, np.int64), "obs": obs})
            actor.flush(args["timeout"])
            reports.put({"plane": actor.transport, "steps_sent": args["chunks"] * chunk})
            held.wait(args["timeout"])  # stay connected until the learner has fetched everything
    except BaseException:  # noqa: BLE001 - reported to the learner, which fails the row
        reports.put({"error": traceback.format_exc()})
        raise SystemExit(1) from None


def _percentiles(values_ns: list[int]) -> dict[str, float]:
    if not values_ns:
        return {"count": 0}
    us = np.asarray(values_ns, np.float64) / 1e3
    p50, p99 = np.percentile(us, [50, 99])
    return {"count": int(us.size), "p50_us": float(p50), "p99_us": float(p99), "max_us": float(us.max()),
            "mean_us": float(us.mean())}  # fmt: skip


def measure(transport: str, device: str, args: dict[str, int]) -> dict[str, Any]:
    import torch

    from rlink_ucx import Learner, RLinkDataset

    cuda = device.startswith("cuda")
    chunk, timeout = args["chunk"], args["timeout"]
    ctx = mp.get_context("spawn")
    reports, held = ctx.Queue(), ctx.Event()
    latencies: list[int] = []
    ready_fetch: list[int] = []
    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=chunk, device=device)
        proc = ctx.Process(target=_actor, args=(learner.address, transport, device, args, reports, held))
        proc.start()
        try:
            for _ in range(args["warmup"] + args["chunks"]):
                batch = dataset.fetch(timeout=timeout)
                if cuda:
                    torch.cuda.synchronize(device)
                now = time.monotonic_ns()
                stamps = batch["t_ns"].cpu().numpy()
                latencies.extend(int(now - t) for t in stamps[stamps >= 0])
            report = reports.get(timeout=timeout)  # after the actor's last flush: all held here
            if "error" in report:
                raise RuntimeError(f"the actor failed:\n{report['error']}")
            for _ in range(args["ready"]):
                t0 = time.monotonic_ns()
                batch = dataset.fetch(timeout=timeout)
                if cuda:
                    torch.cuda.synchronize(device)
                ready_fetch.append(time.monotonic_ns() - t0)
            held.set()
            proc.join(timeout)
            if proc.exitcode != 0:
                raise RuntimeError(f"the actor process exited with {proc.exitcode}")
        finally:
            held.set()
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    return {"transport": transport, "plane": report["plane"], "device": device, "steps_sent": report["steps_sent"],
            "latency": _percentiles(latencies), "ready_fetch": _percentiles(ready_fetch)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0", help='where steps and batches live: "cuda:N" or "cpu"')
    parser.add_argument("--transport", default="tcp,ucx,shm", help="planes, comma-separated: auto, tcp, ucx, shm")
    parser.add_argument("--chunks", type=int, default=300, help="chunks measured per plane")
    parser.add_argument("--chunk", type=int, default=64, help="steps per chunk (= steps per batch)")
    parser.add_argument("--obs-bytes", type=int, default=4096, help="bytes of each step's obs")
    parser.add_argument("--warmup", type=int, default=20, help="chunks sent first and not counted")
    parser.add_argument("--ready", type=int, default=20, help="batches fetched once already held")
    parser.add_argument("--timeout", type=int, default=60, help="seconds any single wait may take")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"bench": "gpu_latency", "device": args.device, "python": sys.version.split()[0],
                           "cpus": os.cpu_count(), "chunk": args.chunk, "obs_bytes": args.obs_bytes, "rows": []}  # fmt: skip

    def finish(code: int, message: str | None = None) -> int:
        if message:
            out["error"] = message
            print(f"gpu_latency: {message}", file=sys.stderr)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return code

    import torch

    out["cuda"] = torch.cuda.is_available()
    if args.device != "cpu" and not out["cuda"]:
        return finish(
            EXIT_NO_CUDA,
            f"device {args.device} requested but no CUDA device is visible (torch.cuda.is_available() is False)",
        )
    knobs = {k: getattr(args, k) for k in ("chunks", "chunk", "obs_bytes", "warmup", "ready", "timeout")}
    print(f"{'plane':<12}{'steps':>8}{'p50 us':>10}{'p99 us':>10}{'max us':>10}   ready fetch p50 / p99 us")
    failed = []
    for transport in args.transport.split(","):
        if transport == "ucx" and importlib.util.find_spec("ucxx") is None:
            out["rows"].append({"transport": transport, "skipped": "ucxx is not installed"})
            print(f"{transport:<12}skipped: ucxx is not installed", flush=True)
            continue
        try:
            row = measure(transport, args.device, knobs)
        except Exception as exc:  # noqa: BLE001 - one plane failing still leaves the others' rows
            traceback.print_exc()
            failed.append(transport)
            out["rows"].append({"transport": transport, "error": str(exc).splitlines()[0] if str(exc) else repr(exc)})
            continue
        out["rows"].append(row)
        lat, ready = row["latency"], row["ready_fetch"]
        name = transport if row["plane"] == transport else f"{transport}->{row['plane']}"
        print(f"{name:<12}{lat['count']:>8}{lat['p50_us']:>10.0f}{lat['p99_us']:>10.0f}{lat['max_us']:>10.0f}"
              f"   {ready['p50_us']:.0f} / {ready['p99_us']:.0f}", flush=True)  # fmt: skip
    if failed:
        return finish(1, f"failed on {', '.join(failed)}")
    return finish(0)


if __name__ == "__main__":
    sys.exit(main())

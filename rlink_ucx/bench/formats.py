"""``rlink bench --suite formats``: the rate at which a learner fetches batches as torch, numpy,
JAX or TensorFlow arrays (``RLinkDataset(format=...)``), against torch in the same run.

Each row is the default suite's rlink row (``bench/rlink.py``: actor processes ``put_many``
steps over tcp, the learner fetches batches of about 4 MiB and reads each batch's ``t_ns``
stamps), with only the batch format changed. Workloads: Atari steps 32 per call and CartPole
steps 256 per call. JAX runs with ``jax_enable_x64`` on, so the int64 stamps stay int64 (without
it JAX copies 64-bit fields into 32-bit ones). A format whose framework is missing is skipped.

Usage: rlink bench --suite formats [--formats torch,numpy,jax,tensorflow] [--rounds 3] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from ..wire.frameworks import FORMATS, importable
from .measure import Timing
from .rlink import run_rlink
from .workloads import ATARI, CARTPOLE

ROWS = ((ATARI, 32), (CARTPOLE, 256))


def build_parser() -> argparse.ArgumentParser:
    """The ``rlink bench --suite formats`` options (docs/cli.md is generated from them)."""
    parser = argparse.ArgumentParser(prog="rlink bench --suite formats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma list; torch is the baseline")
    parser.add_argument("--actors", type=int, default=1, help="actor processes streaming to the learner")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (windows) per format")
    parser.add_argument("--window", type=float, default=0.6, help="seconds per repetition")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds dropped at the start of each run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over the formats, interleaved (a busy machine's drift hits each alike); "
                             "each format's median over them is compared")  # fmt: skip
    parser.add_argument("--handover-only", action="store_true", help="only the in-process handover cost (seconds)")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    timing = Timing(warmup=args.warmup, window=args.window, reps=args.reps, timeout=60.0)
    if "jax" in formats and importable("jax"):
        import jax

        jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]
    records: list[dict[str, Any]] = handover(formats)
    if args.handover_only:
        rows: tuple[Any, ...] = ()
    else:
        rows = ROWS
    for workload, chunk in rows:
        runs: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for fmt in formats:
                record: dict[str, Any] = {"workload": workload.name, "chunk": chunk, "format": fmt,
                                          "actors": args.actors, "round": r}  # fmt: skip
                if not importable(fmt):
                    record["skipped"] = f"{fmt} is not installed"
                else:
                    t0 = time.monotonic()
                    record.update(run_rlink(workload.with_chunk(chunk), timing, "tcp", args.actors, "put_many", fmt))
                    record["seconds"] = round(time.monotonic() - t0, 1)
                    runs.setdefault(fmt, []).append(record["per_s"])
                records.append(record)
                print(_line(record, [x for x in records if x.get("round") == r]), flush=True)
        base = statistics.median(runs["torch"]) if runs.get("torch") else None
        for fmt, rates in runs.items():
            median = statistics.median(rates)
            ratio = f"  {median / base:.2f}x torch" if base else ""
            print(f"{workload.name:<9} x{chunk:<4} {fmt:<11}median of {len(rates)}: {median / 1e3:10.1f} k steps/s{ratio}",
                  flush=True)  # fmt: skip
            records.append({"workload": workload.name, "chunk": chunk, "format": fmt, "median_per_s": median,
                            "vs_torch": None if not base else median / base})  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0


def handover(formats: list[str], batches: int = 200) -> list[dict[str, Any]]:
    """CPU time (this thread's, so other processes' load barely moves it) to hand one batch over
    as each format and read every field and metadata array: typed views of a 64-byte aligned
    staging buffer (``wire.frameworks.typed``), ``batch.Host`` values, the adapter on access.
    The batch sizes are the end-to-end rows' (``rlink_config``)."""
    import numpy as np

    from ..batch import Batch, Host
    from ..wire.frameworks import adapter, aligned, typed
    from .rlink import rlink_config

    out = []
    for workload, chunk in ROWS:
        _, n = rlink_config(workload.with_chunk(chunk))
        fields = [(name, dtype, (n, *shape)) for name, dtype, shape in workload.fields]
        hosts = [aligned((int(np.prod(shape)) * np.dtype(dtype).itemsize,)) for _, dtype, shape in fields]
        meta = np.zeros((4, n), np.int64)
        for fmt in formats:
            if not importable(fmt):
                continue
            convert = adapter(fmt).array
            samples = []
            for _ in range(batches):
                t0 = time.thread_time_ns()
                batch = Batch({name: Host(typed(h, dtype, shape), dtype) for (name, dtype, shape), h in zip(fields, hosts)},
                              version=Host(meta[0], "int64"), actor_id=Host(meta[1], "int64"),
                              seq=Host(meta[2], "int64"), staleness=Host(meta[3], "int64"), convert=convert)  # fmt: skip
                for name in batch:
                    batch[name]
                batch.version, batch.actor_id, batch.seq, batch.staleness  # noqa: B018 - read, as a learner would
                samples.append(time.thread_time_ns() - t0)
                del batch
            us = statistics.median(samples) / 1e3
            out.append({"workload": workload.name, "chunk": chunk, "format": fmt, "batch": n, "handover_us": us})
            print(f"handover {workload.name:<9} batch {n:<7} {fmt:<11}{us:8.1f} us CPU per batch (all fields and "
                  f"metadata read)", flush=True)  # fmt: skip
    return out


def _line(record: dict[str, Any], records: list[dict[str, Any]]) -> str:
    head = f"{record['workload']:<9} x{record['chunk']:<4} {record['format']:<11}"
    if "skipped" in record:
        return head + f"skipped: {record['skipped']}"
    base = next((r for r in records if r["workload"] == record["workload"] and r["format"] == "torch"
                 and "per_s" in r), None)  # fmt: skip
    ratio = f"  {record['per_s'] / base['per_s']:.2f}x torch" if base is not None else ""
    return (head + f"{record['per_s'] / 1e3:10.1f} k steps/s  {record['gbps']:6.2f} GB/s "
            f"(min {record['gbps_min']:.2f}, max {record['gbps_max']:.2f})  p50 {record['p50_us']:.0f} us{ratio}")

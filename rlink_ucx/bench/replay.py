"""Replay benchmarks: sampling rates, insert rate against RLinkDataset, checkpoint speed vs disk.

    rlink bench --suite replay [--only uniform,prioritized,insert,checkpoint] [--quick] [--json [PATH]]

- ``uniform``: ``ReplayDataset.sample()`` of B=256 Atari-sized steps (obs uint8 84x84x4 +
  action, reward, done) from a full table of ``--atari-capacity`` steps: batches/s and items/s,
  with the table in host memory or, with ``--storage device``, on ``--device`` (a device
  gather); ``--device cuda:0`` returns the batches on the GPU.
- ``prioritized``: at capacity ``--capacity`` (1M) of small steps, ms per ``sample()`` +
  ``update_priorities()`` of B=256 through the replay, and the sum tree's own share.
- ``insert``: one actor process streams the same workload over the learner's default plane
  into ``RLinkDataset`` (fetch loop) and into ``ReplayDataset`` (inserter thread only), runs
  alternating; steps/s of each and their ratio.
- ``checkpoint``: save and load of a ``--ckpt-gb`` GB table against a plain sequential file
  write (+ fsync) and read of the same size in the same run; the page cache is dropped before
  each read where the kernel allows it (root), and the report says whether it was. Also an
  ``O_DIRECT`` write and read of that size: the device without the page cache.

``--reverb PYTHON`` runs ``bench/reverb_side.py`` (a source checkout's; the wheel leaves it out)
with an interpreter that has dm-reverb, right after the uniform run, and reports the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import SOURCE_ROOT
from .peers import CHECKOUT
from .replay_disk import bench_checkpoint
from .replay_runs import B, bench_insert, bench_prioritized, bench_uniform

MEASURES = ("uniform", "prioritized", "insert", "checkpoint")
REVERB_SIDE = Path(SOURCE_ROOT, "bench", "reverb_side.py")  # runs in Reverb's interpreter, not this one


def build_parser() -> argparse.ArgumentParser:
    """The ``rlink bench --suite replay`` options (docs/cli.md is generated from them)."""
    parser = argparse.ArgumentParser(prog="rlink bench --suite replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--suite", choices=["replay"], default="replay", help=argparse.SUPPRESS)
    parser.add_argument("--only", default=",".join(MEASURES), help="comma list of " + ", ".join(MEASURES))
    parser.add_argument("--quick", action="store_true", help="small sizes, short runs (for tests): capacities 2000 "
                        "and 100000, 0.2 GB, 1 s, 1 rep, 300 prioritized calls, unless given")  # fmt: skip
    parser.add_argument("--atari-capacity", type=int, default=20_000, help="uniform: steps held [20000]")
    parser.add_argument("--capacity", type=int, default=1_000_000, help="prioritized: capacity [1000000]")
    parser.add_argument("--ckpt-gb", type=float, default=4.0, help="checkpoint: table size, GB [4]")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint: where the files go [the temporary directory]")
    parser.add_argument("--seconds", type=float, default=3.0, help="uniform / insert: seconds per run [3]")
    parser.add_argument("--reps", type=int, default=2, help="insert / checkpoint: alternating runs [2]")
    parser.add_argument("--prioritized-reps", type=int, default=2000, help="prioritized: timed calls [2000]")
    parser.add_argument("--device", default="cpu", help="uniform / checkpoint: the replay's device (cpu, cuda:0) [cpu]")
    parser.add_argument("--prefetch", type=int, default=None,
                        help="uniform: ReplayDataset(prefetch=...), batches drawn ahead by two threads "
                             "[default: the replay's own choice, 2 here]")  # fmt: skip
    parser.add_argument("--storage", choices=["host", "device"], default="host",
                        help="uniform / checkpoint: the table in host memory or on --device [host]")  # fmt: skip
    parser.add_argument("--reverb", metavar="PYTHON", help="an interpreter with dm-reverb: run bench/reverb_side.py "
                        "(source checkout) with it right after the uniform run and report the ratio")  # fmt: skip
    parser.add_argument(
        "--json", nargs="?", const="-", default=None, help="write the report as JSON (to PATH or stdout)"
    )
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    if "--quick" in (argv or []):  # smaller defaults; sizes given on the command line still win
        parser.set_defaults(
            atari_capacity=2000, capacity=100_000, ckpt_gb=0.2, seconds=1.0, reps=1, prioritized_reps=300
        )
    args = parser.parse_args(argv)
    if args.reverb and not REVERB_SIDE.is_file():
        parser.error(f"--reverb: {REVERB_SIDE.relative_to(SOURCE_ROOT)} is not in the installed wheel: {CHECKOUT}")
    args.ckpt_dir = args.ckpt_dir or tempfile.gettempdir()
    args.only = [m.strip() for m in args.only.split(",") if m.strip()]
    bad = [m for m in args.only if m not in MEASURES]
    if bad or not args.only:
        parser.error(f"--only: unknown measure(s) {', '.join(bad) or args.only!r} (choose from {', '.join(MEASURES)})")
    if (
        min(args.atari_capacity, args.capacity) < B
        or min(args.ckpt_gb, args.seconds, args.reps, args.prioritized_reps) <= 0
    ):
        parser.error(f"capacities must be >= {B}; --ckpt-gb, --seconds, --reps and --prioritized-reps must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    if "uniform" in args.only:
        report["uniform"] = u = bench_uniform(args.atari_capacity, args.seconds, args.device, args.storage, args.prefetch)
        log(f"uniform B={B} Atari ({u['storage']} table, batches on {u['device']}): {u['batches_per_s']} batches/s "
            f"= {u['items_per_s']} items/s (prefetch {u['prefetch']})")  # fmt: skip
        if args.reverb:
            report["reverb"] = r = reverb(args.reverb, args.atari_capacity, args.seconds)
            for path in ("tfdata", "client"):
                r[f"rlink_vs_{path}"] = round(u["items_per_s"] / r[f"{path}_items_per_s"], 2)
            log(f"reverb {r['reverb']}: tf.data {r['tfdata_items_per_s']} items/s (rlink {r['rlink_vs_tfdata']}x), "
                f"Client.sample {r['client_items_per_s']} items/s (rlink {r['rlink_vs_client']}x)")  # fmt: skip
    if "prioritized" in args.only:
        report["prioritized"] = p = bench_prioritized(args.capacity, args.prioritized_reps)
        log(f"prioritized B={B} at {p['capacity']}: {p['ms_per_sample_update']} ms sample+update "
            f"(tree {p['sum_tree_ms']} ms)")  # fmt: skip
    if "insert" in args.only:
        report["insert"] = bench_insert(args.seconds, args.reps)
        for row in report["insert"]:
            log(f"insert {row['workload']}: replay {row['replay_steps_per_s']}/s vs RLinkDataset "
                f"{row['rlinkdataset_steps_per_s']}/s = {row['ratio']}x")  # fmt: skip
    if "checkpoint" in args.only:
        report["checkpoint"] = c = bench_checkpoint(args.ckpt_gb, args.ckpt_dir, args.reps, args.storage, args.device)
        log(f"checkpoint {c['table_gb']} GB: save {c['save_gb_s']} GB/s ({c['save_vs_disk']}x disk write "
            f"{c['disk_write_gb_s']}), load {c['load_gb_s']} GB/s ({c['load_vs_disk']}x disk read {c['disk_read_gb_s']}),"
            f" page cache dropped: {c['page_cache_dropped']}; O_DIRECT write {c['direct_write_gb_s']}, read "
            f"{c['direct_read_gb_s']} GB/s; runs {c['runs_gb_s']}")  # fmt: skip
    if args.json == "-":
        print(json.dumps(report, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def reverb(python: str, capacity: int, seconds: float) -> dict[str, Any]:
    """Reverb's rates on the same table, from ``bench/reverb_side.py`` run by ``python``."""
    done = subprocess.run([python, str(REVERB_SIDE), "--capacity", str(capacity), "--seconds", str(seconds)],
                          capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

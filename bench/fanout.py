"""Parameter fan-out: ``learner.publish`` of a state dict vs one plain broadcast, in one run.

The measurement is ``rlink_ucx.bench.fanout.run`` (also the ``fanout`` rows of ``rlink bench``);
its docstring says what each side's time covers. This is its command line.

Usage: python bench/fanout.py [--size-mb 100] [--subscribers 3] [--reps 5] [--device cuda:0]
       [--no-shared-memory] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from rlink_ucx.bench import fanout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=fanout.__doc__, epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--subscribers", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=25)
    parser.add_argument("--device", default="cpu", help='where the published state dict lives, e.g. "cuda:0"')
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="the actors take versions on their weights streams instead of reading the learner's "
                             "shared memory")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    out = fanout.run(args.size_mb, args.subscribers, args.reps, args.tensors, args.device, not args.no_shared_memory)
    for name, values in out["seconds"].items():
        print(f"{name:16s} median {statistics.median(values) * 1e3:8.1f} ms   "
              f"min {min(values) * 1e3:8.1f}   max {max(values) * 1e3:8.1f}")  # fmt: skip
    print(f"rlink / plain = {out['ratio']:.2f} (ratio of medians), {out['paired_ratio']:.2f} (median of paired "
          "ratios); target <= 1.25")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

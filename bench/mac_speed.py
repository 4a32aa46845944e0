"""Bucket tagging speed: ``VersionKey.tags`` of a model on one core, as ``publish()`` runs it.

Tags ``--mb`` MiB of random bytes split into buckets of ``--bucket-mb`` MiB with a fresh
version key each rep (what every published version costs), in this process, on the cores it may
use (``taskset -c 0`` pins it to one). Prints the median time and GB/s (10**9 bytes/s), the CPU
and the flags its speed depends on. A model of 64 MiB or more in several buckets is tagged on
up to 4 threads (``mac.VersionKey.tags``): ``--mb 16`` measures one thread.

``--torch`` imports torch first, as a torch learner has (the tags do not depend on it).
``OPENSSL_ia32cap`` (OpenSSL's own variable) hides CPU features from OpenSSL, to measure the
code a CPU without them runs: ``OPENSSL_ia32cap=":~0x10000"`` hides AVX-512 (AVX2, AES-NI and
PCLMULQDQ stay), as on an AMD EPYC without AVX-512.

Usage: python bench/mac_speed.py [--mb 16] [--bucket-mb 32] [--reps 30] [--torch] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np


def cpu() -> dict[str, Any]:
    """The CPU's model name and which of the flags that matter here it has."""
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ["aes", "pclmulqdq", "avx2", "avx512f", "vaes", "vpclmulqdq", "avx512_vnni"]
    return {"model": model, "flags": {f: f in flags for f in wanted}}


def measure(mb: int, bucket_mb: int, reps: int) -> dict[str, float]:
    from rlink_ucx.weights import mac

    data = np.random.default_rng(0).integers(0, 256, mb << 20, dtype=np.uint8)
    step = bucket_mb << 20
    buckets = [(a, min(a + step, len(data))) for a in range(0, len(data), step)]
    mac.VersionKey().tags(data, buckets, 1)  # warm: OpenSSL's and numpy's first use
    seconds = []
    for rep in range(reps):
        key = mac.VersionKey()
        t = time.perf_counter()
        key.tags(data, buckets, rep + 1)
        seconds.append(time.perf_counter() - t)
    median = statistics.median(seconds)
    return {"bytes": len(data), "buckets": len(buckets), "median_s": median, "min_s": min(seconds),
            "gb_per_s": len(data) / median / 1e9, "cores": len(os.sched_getaffinity(0))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=16)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--torch", action="store_true", help="import torch first, as a torch learner has")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.torch:
        import torch  # noqa: F401 - what a torch learner's process has loaded

    info, result = cpu(), measure(args.mb, args.bucket_mb, args.reps)
    cap = os.environ.get("OPENSSL_ia32cap")
    flags = ", ".join(f for f, on in info["flags"].items() if on)
    print(f"{info['model']}: {flags}{'; OPENSSL_ia32cap=' + cap if cap else ''}")
    print(f"tags of {args.mb} MiB in {result['buckets']} bucket(s) on {result['cores']} core(s): median "
          f"{result['median_s'] * 1e3:.2f} ms (min {result['min_s'] * 1e3:.2f}), {result['gb_per_s']:.2f} GB/s")
    out = {"cpu": info, "openssl_ia32cap": cap, "torch": "torch" in sys.modules, **result}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

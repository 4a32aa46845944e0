"""Replay benchmarks (sampling, insert rate, checkpoint speed); see rlink_ucx/bench/replay.py (also `rlink bench --suite replay`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlink_ucx, installed or not

from rlink_ucx.bench.replay import main

if __name__ == "__main__":
    sys.exit(main())

"""Many actors into one learner: connect time, delivery, latency, CPU and memory against N; see rlink_ucx/bench/scale.py (also `rlink bench --suite scale`)."""

import sys

from rlink_ucx.bench.scale import main

if __name__ == "__main__":
    sys.exit(main())

"""rlink against its limits and peers on the same workloads; see rlink_ucx/bench/suite.py (also `rlink bench`)."""

import sys

from rlink_ucx.bench.suite import main

if __name__ == "__main__":
    sys.exit(main())

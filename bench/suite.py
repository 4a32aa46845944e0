"""rlink against its limits and peers on the same workloads; see rlink_ucx/_bench_suite.py (also `rlink bench`)."""

import sys

from rlink_ucx.bench.suite import main

if __name__ == "__main__":
    sys.exit(main())

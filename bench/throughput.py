"""Actor -> learner throughput vs a raw socket; see rlink_ucx/bench/throughput.py."""

import sys

from rlink_ucx.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())

"""Actor -> learner throughput vs a raw socket; see rlink_ucx/_bench.py (also `rlink bench`)."""

import sys

from rlink_ucx.bench.common import main

if __name__ == "__main__":
    sys.exit(main())

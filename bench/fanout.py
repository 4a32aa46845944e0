"""Parameter fan-out: learner.publish vs a plain broadcast; see rlink_ucx/bench/fanout.py."""

import sys

from rlink_ucx.bench.fanout import main

if __name__ == "__main__":
    sys.exit(main())

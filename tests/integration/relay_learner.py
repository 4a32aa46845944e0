"""A learner for the relay tests, run on host 0 of a set of network namespaces
(``rlink_ucx/bench/netns.py``) and driven line by line on its standard input:

    python -m tests.integration.relay_learner DEVICE FLOATS

It prints ``port N`` once listening, then answers each command with one JSON line:

- ``publish V [WAIT]``: publish version V (``np.full(FLOATS, V)``) and wait up to WAIT seconds
  (default 60) until every live actor has it: the seconds that took, whether all did, and the
  bytes the learner's link (DEVICE) sent meanwhile;
- ``stats``: ``learner.stats()["weights"]`` and each actor's version;
- ``quit``: close the learner (the actors end their loops).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def main(device: str, floats: int) -> None:
    from rlink_ucx import Learner

    def sent() -> int:
        with open(f"/sys/class/net/{device}/statistics/tx_bytes") as f:
            return int(f.read())

    with Learner("0.0.0.0:0", transport="tcp") as learner:
        print(f"port {learner.address.rsplit(':', 1)[1]}", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["publish"]:
                version, wait = int(words[1]), float(words[2]) if len(words) > 2 else 60.0
                before, started = sent(), time.monotonic()
                published = learner.publish({"w": np.full(floats, version, np.float32)})
                confirmed = learner.wait_published(published, timeout=wait)
                print(json.dumps({"version": published, "seconds": time.monotonic() - started, "confirmed": confirmed,
                                  "sent": sent() - before}), flush=True)  # fmt: skip
            elif words[:1] == ["stats"]:
                stats = learner.stats()
                print(json.dumps({"weights": stats["weights"],
                                  "actors": {a["actor_id"]: a["weights_version"] for a in stats["actors"]}},
                                 default=str), flush=True)  # fmt: skip
            elif words[:1] == ["quit"]:
                break


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""One actor of the multi-learner tests: knows only rank 0's address (read from a file the
learner writes), puts ``--steps`` steps whose ``x`` is their seq, follows the published
versions in a thread, and writes what it saw to ``<out>/actor<i>.json``.

    python tests/integration/ranks_actor.py --out DIR --index 3 --steps 600 --versions 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--actor-id", type=int, default=None, help="default: the learner gives one")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--versions", type=int, default=0, help="follow published versions up to this one")
    p.add_argument("--pace", type=float, default=0.002, help="seconds between puts")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--host", default=None, help="rank 0's host as this actor reaches it (default: from the file)")
    p.add_argument("--address", default=None, help="rank 0's address (then the file is not waited for)")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    import numpy as np

    from rlink_ucx import Actor, Config, RLinkError

    address = args.address or _address_from_file(args.out)
    if args.host is not None:  # rank 0 listens on all interfaces: the file has 0.0.0.0
        address = f"{args.host}:{address.rsplit(':', 1)[1]}"
    result: dict = {"index": args.index, "seen": [], "error": None}
    config = Config(reconnect_timeout=float(os.environ.get("RLINK_RECONNECT_TIMEOUT", "30")))
    try:
        with Actor(address, transport=args.transport, actor_id=args.actor_id, config=config,
                   subscribe=args.versions > 0) as actor:  # fmt: skip
            follower = None
            if args.versions:
                follower = threading.Thread(target=_follow, args=(actor, args.versions, result), daemon=True)
                follower.start()
            for seq in range(args.steps):
                actor.put({"x": np.full(2, seq, np.int64)})
                if seq == 0:
                    actor.flush(timeout=60)
                    open(os.path.join(args.out, f"actor{args.index}.connected"), "w").close()
                time.sleep(args.pace)
            actor.flush(timeout=60)
            if follower is not None:
                follower.join(90)
            result["actor_id"] = actor.actor_id
            result["learner_rank"] = actor.stats()["learner_rank"]
            result["weights"] = actor.stats()["weights"]
    except RLinkError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(args.out, f"actor{args.index}.json"), "w") as fh:
        json.dump(result, fh)
    return 0


def _address_from_file(out: str) -> str:
    address_file = os.path.join(out, "address")
    deadline = time.monotonic() + 60
    while not os.path.exists(address_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(address_file) as fh:
        return fh.read().strip()


def _follow(actor, until: int, result: dict) -> None:
    import numpy as np

    seen = result["seen"]
    while not seen or seen[-1] < until:
        state, version = actor.get_remote_model(timeout=90, latest=False)  # ({}, 0): none here yet
        if version and (not seen or seen[-1] != version):
            seen.append(version)
            result["w"] = float(np.asarray(state["w"])[0])
            result["exact"] = result.get("exact", True) and bool(np.all(np.asarray(state["w"]) == np.float32(version)))
        time.sleep(0.002)


if __name__ == "__main__":
    sys.exit(main())

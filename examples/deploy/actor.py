"""Deployment entry: an actor that streams numbered synthetic steps to the learner.

The recipes in docs/deploy/ start this script (directly, or through launch.py on every rank
but 0); replace its loop with your environment. It may start before the learner (it waits up
to ``Config.connect_timeout``, 120 s)::

    RLINK_ADDRESS=learner:8443 RLINK_TOKEN_FILE=/run/secrets/rlink_token python examples/deploy/actor.py --steps 10000

Variables: ``RLINK_ADDRESS`` (the learner's host:port), ``RLINK_TOKEN`` / ``RLINK_TOKEN_FILE``,
``RLINK_TRANSPORT``, ``RLINK_ACTOR_ID`` (a stable id; the learner assigns one when unset).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("RLINK_ADDRESS"),
                   help="the learner's host:port (env RLINK_ADDRESS)")
    p.add_argument("--transport", default=os.environ.get("RLINK_TRANSPORT", "auto"),
                   help="data plane (env RLINK_TRANSPORT): auto, tcp, ucx or shm")
    p.add_argument("--actor-id", type=int, default=int(os.environ["RLINK_ACTOR_ID"]) if os.environ.get("RLINK_ACTOR_ID")
                   else None, help="a stable actor id (env RLINK_ACTOR_ID; default: the learner assigns one)")
    p.add_argument("--steps", type=int, default=int(os.environ.get("RLINK_STEPS", "10000")),
                   help="steps to send, then flush and exit (0: until the learner finishes)")
    p.add_argument("--obs-dim", type=int, default=16, help="float32 observation size")
    args = p.parse_args(argv)
    if not args.address:
        p.error("no learner address: pass --address or set RLINK_ADDRESS=host:port")
    return args


def run(args: argparse.Namespace) -> int:
    from rlink_ucx import Actor, Closed, RLinkError

    chunk = 64
    sent = 0
    try:
        with Actor(args.address, transport=args.transport, actor_id=args.actor_id) as actor:
            print(f"actor {actor.actor_id} connected to {args.address} over {actor.transport} "
                  f"({actor.transport_reason})", flush=True)
            while not args.steps or sent < args.steps:
                k = chunk if not args.steps else min(chunk, args.steps - sent)
                seq = np.arange(sent, sent + k)
                actor.put_many({"obs": np.repeat(seq[:, None].astype(np.float32), args.obs_dim, axis=1),
                                "action": seq.astype(np.int64), "reward": np.ones(k, np.float32),
                                "done": seq % 200 == 199})  # fmt: skip
                sent += k
            actor.flush(60)
    except Closed as exc:  # the learner finished first: what it acknowledged is delivered
        print(f"actor: the learner finished after {sent} steps ({exc})", flush=True)
        return 0
    except RLinkError as exc:
        print(f"actor stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"actor sent {sent} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(parse()))

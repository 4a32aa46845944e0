"""Deployment entry: a learner that drains actor steps, checks them, and reports.

The recipes in docs/deploy/ (docker compose, Kubernetes, torchrun, SLURM) start this script
(directly, or through launch.py on rank 0); replace its loop with your training loop. Every
option has an environment form, so a container or a job script sets only variables::

    RLINK_TOKEN_FILE=/run/secrets/rlink_token python examples/deploy/learner.py --listen 0.0.0.0:8443

Variables: ``RLINK_LISTEN`` (host:port to bind; a non-loopback address needs a token),
``RLINK_TOKEN`` / ``RLINK_TOKEN_FILE`` (the shared secret), ``RLINK_TRANSPORT`` (auto, tcp, ucx, shm).
With ``--expect-steps N`` it exits 0 once N steps arrived (each actor numbers its steps
0, 1, 2, ... in the ``action`` field: the check that they arrived in order, exactly once).

``--distributed`` (env ``RLINK_DISTRIBUTED=1``): one learner rank of many, started on every
rank of a learner-only job (``torchrun --nproc-per-node N examples/deploy/learner.py
--distributed``, or launch.py with ``RLINK_LEARNERS=N``): ``Learner(distributed=True)``; rank 0
listens on ``--listen``, the address actors are given. Each rank drains its own actors' steps;
``--expect-steps`` counts the steps of all ranks (summed over the job's own default process
group once a round: this script makes it, gloo, where the launcher did not; rlink's ranks do not
need it, they meet over rlink's authenticated rank links), and ``--summary FILE`` becomes one file per rank, ``FILE`` with ``.rank<r>`` before
its extension.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", default=os.environ.get("RLINK_LISTEN", "0.0.0.0:8443"),
                   help="host:port to listen on (env RLINK_LISTEN; default 0.0.0.0:8443, which needs a token)")
    p.add_argument("--transport", default=os.environ.get("RLINK_TRANSPORT", "auto"),
                   help="data plane (env RLINK_TRANSPORT): auto, tcp, ucx or shm")
    p.add_argument("--expect-steps", type=int, default=int(os.environ.get("RLINK_EXPECT_STEPS", "0")),
                   help="exit once this many steps arrived (0: run until stopped)")
    p.add_argument("--batch-size", type=int, default=256, help="steps per fetch when running until stopped")
    p.add_argument("--summary", default=None, help="write a JSON summary here on exit")
    p.add_argument("--seconds", type=float, default=0, help="give up after this long (0: no limit)")
    p.add_argument("--distributed", action="store_true", default=os.environ.get("RLINK_DISTRIBUTED", "") == "1",
                   help="one rank of a learner-only torch.distributed job (env RLINK_DISTRIBUTED=1)")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between progress lines")
    return p.parse_args(argv)


def batch_size_for(expect: int, default: int) -> int:
    """A batch size that divides ``expect`` (so the last step is fetched too), at most 1024."""
    if expect <= 0:
        return default
    return max(d for d in range(1, min(1024, expect) + 1) if expect % d == 0)


def summary_path(path: str, rank: int | None) -> str:
    """Rank r of a distributed learner writes ``summary.rank<r>.json`` for ``summary.json``."""
    if rank is None:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


class Total:
    """The steps of every rank: a sum over the default process group, once a round on every rank
    (a distributed learner), or this process's own count."""

    def __init__(self, distributed: bool):
        self.distributed = distributed
        if distributed:
            import torch.distributed as dist

            if not dist.is_initialized():  # the job's own group, for this sum (rlink makes none)
                dist.init_process_group("gloo")

    def __call__(self, received: int) -> int:
        if not self.distributed:
            return received
        import torch
        import torch.distributed as dist

        total = torch.tensor([received], dtype=torch.int64)
        dist.all_reduce(total)
        return int(total.item())


def run(args: argparse.Namespace) -> int:
    from rlink_ucx import Learner, RLinkDataset
    from rlink_ucx import TimeoutError as RLinkTimeout

    counts: dict[int, int] = {}
    in_order = True
    received = total = 0
    started = time.monotonic()
    total_of = Total(args.distributed)
    with Learner(args.listen, transport=args.transport, distributed=args.distributed) as learner:
        rank = learner.rank if args.distributed else None
        who = f"learner rank {rank} of {learner.world_size}" if args.distributed else "learner"
        print(f"{who} listening on {learner.address} (transport={args.transport})", flush=True)
        # One learner: a batch size that divides the expected steps. A rank of many gets a share
        # of them: the launcher passes one that divides each actor's steps (launch.py).
        size = args.batch_size if args.distributed else batch_size_for(args.expect_steps, args.batch_size)
        dataset = RLinkDataset(learner, batch_size=size)
        last_log = started
        while not args.expect_steps or total < args.expect_steps:
            if total_of(int(args.seconds > 0 and time.monotonic() - started > args.seconds)):
                break  # the time is up (for one rank: for all of them, in the same round)
            try:
                batch = dataset.fetch(timeout=1.0)
            except RLinkTimeout:
                total = total_of(received)
                continue
            for actor, seq, action in zip(batch.actor_id.tolist(), batch.seq.tolist(), batch["action"].tolist()):
                in_order &= seq == action == counts.get(actor, 0)
                counts[actor] = counts.get(actor, 0) + 1
            received += len(batch.seq)
            total = total_of(received)
            if time.monotonic() - last_log >= args.log_every:
                last_log = time.monotonic()
                print(f"{who}: {received} steps from {len(counts)} actors", flush=True)
        stats = learner.stats()
        transports = sorted({a["transport"] for a in stats["actors"] + stats["ended_actors"]})
    elapsed = time.monotonic() - started
    done = not args.expect_steps or total >= args.expect_steps
    print(f"{who}: {received} steps from {len(counts)} actors over {', '.join(transports) or '-'} in "
          f"{elapsed:.1f}s; in order and exactly once: {in_order}", flush=True)
    if args.summary:
        with open(summary_path(args.summary, rank), "w") as fh:
            json.dump({"address": stats["address"], "steps": received, "per_actor": {str(k): v for k, v in counts.items()},
                       "in_order": in_order, "transports": transports, "complete": done, "rank": rank,
                       "world_size": stats.get("world_size", 1), "total_steps": total}, fh)
    return 0 if done and in_order else 1


if __name__ == "__main__":
    sys.exit(run(parse()))

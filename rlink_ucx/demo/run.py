"""``rlink demo``: a learner and N actor processes train PPO on a Gymnasium env over rlink.

The actors step vectorized envs with the newest published policy and stream trajectories;
the learner reads them from ``RLinkDataset.fetch()``, updates the actor-critic and calls
``learner.publish()`` after every update. It stops when the mean return over the last 100
episodes reaches the target (exit 0), when time runs out (exit 2), or on Ctrl-C (exit 130),
and always writes ``summary.json`` and ``learning_curve.png`` to ``--out``.

``--learners N`` trains one model with DDP over N learner ranks, each on its own actors
(ranks.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any

import numpy as np

from .. import Learner, RLinkDataset
from .. import TimeoutError as RLinkTimeout
from ..transport import TRANSPORT_HELP, TRANSPORTS
from .parts import Setup, kill_one_actor, progress_values, random_return, report, start_actors, stop_actors, summarize


def build_parser() -> argparse.ArgumentParser:
    """The ``rlink demo`` options (docs/cli.md is generated from them)."""
    p = argparse.ArgumentParser(prog="rlink demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--actors", type=int, default=None, help="actor processes (default 4; 2 with --quick)")
    p.add_argument("--transport", choices=list(TRANSPORTS), default="auto", help=TRANSPORT_HELP)
    p.add_argument("--env", default="CartPole-v1", help="Gymnasium env id (discrete or 1-d box actions)")
    p.add_argument("--target-return", type=float, default=475.0,
                   help="stop once the mean return over the last 100 episodes reaches this")
    p.add_argument("--max-seconds", type=float, default=300.0, help="give up (exit code 2) after this long")
    p.add_argument("--device", default="cpu", help="the learner's device, e.g. cuda:0")
    p.add_argument("--seed", type=int, default=1, help="seeds the envs and the policy")
    p.add_argument("--out", default="./rlink-demo", help="where summary.json and learning_curve.png go")
    p.add_argument("--envs-per-actor", type=int, default=4, help="environments each actor steps together")
    p.add_argument("--unroll", type=int, default=32, help="steps per trajectory")
    p.add_argument("--batch", type=int, default=16, help="trajectories per update")
    p.add_argument("--learners", type=int, default=1,
                   help="learner ranks training one model with DDP (gloo on CPU, NCCL on CUDA), each on its own "
                        "actors; --batch is split over them")
    p.add_argument("--quick", action="store_true", help="a short run (45 s at most, target 150), for tests")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--kill-one-actor-after", type=float, default=None, metavar="SECONDS",
                   help="SIGKILL one actor process after this long (once all are streaming), to watch the run carry on")  # fmt: skip
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.actors is None:
        args.actors = 2 if args.quick else 4
    if args.quick:
        args.max_seconds = min(args.max_seconds, 45.0)
        args.target_return = min(args.target_return, 150.0)
    if args.actors < 1:
        p.error("--actors must be at least 1")
    if args.learners < 1:
        p.error("--learners must be at least 1")
    if args.actors < args.learners:
        p.error("--actors must be at least --learners: each learner rank trains on actors of its own")
    return args


def main(argv: list[str] | None = None) -> int:
    from .progress import say

    args = parse_args(argv)
    # Before torch is imported: on a busy machine that alone takes seconds.
    say(f"starting: PPO on {args.env}, {args.actors} actor processes, {args.learners} learner(s), "
        f"at most {args.max_seconds:g} s, target return {args.target_return:g}")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    if args.learners > 1:
        from .ranks import main as ranks_main

        return ranks_main(args)
    return _one_learner(args)


def _one_learner(args: argparse.Namespace) -> int:
    import torch

    from .ppo import PPO, PPOConfig
    from .progress import Progress, say

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the actors need the other core(s)
    setup = Setup(args)
    baseline = random_return(args.env)
    learner = Learner("127.0.0.1:0", transport=args.transport, config=setup.config)
    dataset = RLinkDataset(learner, batch_size=args.batch, device=args.device)
    model = setup.model(args.device)
    ppo = PPO(model, PPOConfig())
    learner.publish(model)
    stop, reports, procs = start_actors(args, learner.address)
    say(f"learner on {learner.address}; {len(procs)} actors starting (progress every 5 s)")

    progress = Progress(plain=args.plain)
    returns: collections.deque[float] = collections.deque(maxlen=100)
    curve: list[tuple[int, float, float]] = []
    episodes = updates = 0
    mean_return = 0.0
    killed: dict[str, Any] | None = None
    outcome = "time limit"
    started = time.monotonic()

    def show(stats: dict[str, Any], elapsed: float) -> None:
        env_steps = stats["total"]["steps"] * args.unroll
        progress.update(progress_values(args, stats, elapsed, mean_return, episodes, learner.version, env_steps))

    try:
        while True:
            elapsed = time.monotonic() - started
            if elapsed > args.max_seconds:
                break
            if all(p.exitcode is not None for p in procs):
                outcome = "every actor exited"
                break
            try:
                batch = dataset.fetch(timeout=progress.due(5.0))
            except RLinkTimeout:  # no batch yet: a line all the same, so the run is never silent
                show(learner.stats(), time.monotonic() - started)
                continue
            done = batch["done"].bool()
            finished = batch["ep_return"][done].tolist()
            returns.extend(finished)
            episodes += len(finished)
            ppo.set_lr_fraction(1.0 - elapsed / args.max_seconds)
            ppo.update(batch)
            updates += 1
            learner.publish(model)
            mean_return = float(np.mean(returns)) if returns else 0.0
            elapsed = time.monotonic() - started
            stats = learner.stats()
            env_steps = stats["total"]["steps"] * args.unroll
            if returns:
                curve.append((env_steps, round(elapsed, 3), mean_return))
            if killed is None and stats["connected_actors"] == len(procs):
                killed = kill_one_actor(args, procs, elapsed)
            show(stats, elapsed)
            if len(returns) == returns.maxlen and mean_return >= args.target_return:
                outcome = "target reached"
                break
    except KeyboardInterrupt:
        outcome = "interrupted"
    finally:
        progress.close()
        wall = time.monotonic() - started
        actor_reports = stop_actors(stop, procs, reports, lambda: dataset.fetch(timeout=0.2))
        stats = learner.stats()
        learner.close()
    summary = summarize(args, outcome, stats, wall, updates, episodes, returns, baseline, actor_reports, killed)
    return report(args, summary, curve)


if __name__ == "__main__":
    import sys

    sys.exit(main())

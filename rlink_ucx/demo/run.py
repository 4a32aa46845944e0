"""``rlink demo``: a learner and N actor processes train PPO on a Gymnasium env over rlink.

The actors step vectorized envs with the newest published policy and stream trajectories;
the learner reads them from ``RLinkDataset.fetch()``, updates the actor-critic and calls
``learner.publish()`` after every update. It stops when the mean return over the last 100
episodes reaches the target (exit 0), when time runs out (exit 2), or on Ctrl-C (exit 130),
and always writes ``summary.json`` and ``learning_curve.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np

from .. import Config, Learner, RLinkDataset
from .. import TimeoutError as RLinkTimeout
from ..transport import TRANSPORT_HELP, TRANSPORTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    p.add_argument("--quick", action="store_true", help="a short run (45 s at most, target 150), for tests")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--kill-one-actor-after", type=float, default=None, metavar="SECONDS",
                   help="SIGKILL one actor process after this long (once all are streaming), to watch the run carry on")  # fmt: skip
    args = p.parse_args(argv)
    if args.actors is None:
        args.actors = 2 if args.quick else 4
    if args.quick:
        args.max_seconds = min(args.max_seconds, 45.0)
        args.target_return = min(args.target_return, 150.0)
    if args.actors < 1:
        p.error("--actors must be at least 1")
    return args


def random_return(env_id: str, episodes: int = 30, seed: int = 0) -> float:
    """The mean return of a uniformly random policy: the bar a trained one must clear."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.action_space.seed(seed)
    total = 0.0
    for i in range(episodes):
        env.reset(seed=seed + i)
        done = False
        while not done:
            _, r, terminated, truncated, _ = env.step(env.action_space.sample())
            total += float(r)
            done = terminated or truncated
    env.close()
    return total / episodes


def trajectory_bytes(obs_dim: int, act_dim: int, discrete: bool, unroll: int) -> int:
    action = 8 if discrete else 4 * act_dim
    return (unroll + 1) * obs_dim * 4 + unroll * (action + 4 + 4 + 1 + 4)


def main(argv: list[str] | None = None) -> int:
    import torch

    from .actor import StopFlag, make_envs, run_actor
    from .policy import ActorCritic, space_spec
    from .ppo import PPO, PPOConfig
    from .progress import Progress
    from .report import plot_curve, write_summary

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the actors need the other core(s)
    probe = make_envs(args.env, 1)
    kind, n = space_spec(probe.single_action_space)
    obs_dim = int(np.prod(probe.single_observation_space.shape))
    probe.close()
    baseline = random_return(args.env)

    # Small buffers keep the policy lag low: actors wait for credit instead of running ahead.
    step_bytes = trajectory_bytes(obs_dim, n, kind == "discrete", args.unroll)
    config = Config(frame_bytes=args.envs_per_actor * step_bytes, buffer_bytes=3 * args.batch * step_bytes,
                    actor_window_bytes=2 * args.envs_per_actor * step_bytes)  # fmt: skip
    token = None
    learner = Learner("127.0.0.1:0", token=token, transport=args.transport, config=config)
    dataset = RLinkDataset(learner, batch_size=args.batch, device=args.device)
    model = ActorCritic(obs_dim, (kind, n)).to(args.device)
    ppo = PPO(model, PPOConfig())
    learner.publish(model)

    ctx = mp.get_context("spawn")
    stop, reports = StopFlag(ctx), ctx.Queue()
    procs = [ctx.Process(target=run_actor, name=f"rlink-demo-actor-{i}",
                         args=(learner.address, token, args.transport, args.env, args.envs_per_actor, args.unroll,
                               args.seed + 1000 * (i + 1), stop, reports))
             for i in range(args.actors)]  # fmt: skip
    # Children inherit an ignored SIGINT through exec, so Ctrl-C during their start-up does not
    # kill them either: the learner stops them through ``stop``.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)

    progress = Progress(plain=args.plain)
    returns: collections.deque[float] = collections.deque(maxlen=100)
    curve: list[tuple[int, float, float]] = []
    episodes = updates = 0
    killed: dict[str, Any] | None = None
    outcome = "time limit"
    started = time.monotonic()
    try:
        while True:
            elapsed = time.monotonic() - started
            if elapsed > args.max_seconds:
                break
            if all(p.exitcode is not None for p in procs):
                outcome = "every actor exited"
                break
            try:
                batch = dataset.fetch(timeout=5)
            except RLinkTimeout:
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
            if (args.kill_one_actor_after is not None and killed is None and elapsed > args.kill_one_actor_after
                    and stats["connected_actors"] == len(procs)):  # fmt: skip
                procs[0].kill()  # SIGKILL, mid-stream: the run must carry on without it
                killed = {"pid": procs[0].pid, "after_seconds": round(elapsed, 2)}
            progress.update({
                "steps": env_steps, "steps_per_s": env_steps / max(elapsed, 1e-9), "transport": _transports(stats),
                "mb_per_s": stats["total"]["bytes"] / max(elapsed, 1e-9) / 1e6, "mean_return": mean_return,
                "target": args.target_return, "episodes": episodes, "lag_mean": stats["staleness"]["mean"],
                "lag_max": stats["staleness"]["max"], "version": learner.version,
                "actors": stats["connected_actors"], "lost": stats["lost_actors"], "elapsed": elapsed,
                "max_seconds": args.max_seconds,
            })  # fmt: skip
            if len(returns) == returns.maxlen and mean_return >= args.target_return:
                outcome = "target reached"
                break
    except KeyboardInterrupt:
        outcome = "interrupted"
    finally:
        progress.close()
        wall = time.monotonic() - started
        actor_reports = _stop_actors(stop, procs, reports, dataset)
        stats = learner.stats()
        learner.close()

    mean_return = float(np.mean(returns)) if returns else 0.0
    lost = [a for a in stats["ended_actors"] if a["state"] == "lost"]
    received = stats["total"]["steps"] * args.unroll
    summary = {
        "outcome": outcome,
        "target_reached": outcome == "target reached",
        "config": {k: v for k, v in vars(args).items()},
        "transport": _transports(stats),
        "total_env_steps": received,
        "env_steps_reported_by_actors": sum(r["env_steps"] for r in actor_reports),
        "env_steps_from_lost_actors": sum(a["steps"] for a in lost) * args.unroll,
        "wall_seconds": round(wall, 3),
        "steps_per_second": round(received / max(wall, 1e-9), 1),
        "updates": updates,
        "model_version": stats["version"],
        "episodes": episodes,
        "final_mean_return_100": round(mean_return, 2),
        "random_policy_return": round(baseline, 2),
        "staleness_mean": round(stats["staleness"]["mean"], 3),
        "staleness_max": stats["staleness"]["max"],
        "bytes_moved": stats["total"]["bytes"],
        "weights": {k: stats["weights"][k] for k in ("published", "fanouts", "streams", "pulls_served", "fanout_failures")},
        "actors_started": args.actors,
        "actors_reported": len(actor_reports),
        "lost_actors": [{"actor_id": a["actor_id"], "pid": a["pid"], "error": a["error"], "env_steps": a["steps"] * args.unroll}
                        for a in lost],
        "killed_on_purpose": killed,
    }
    print(f"[rlink demo] {outcome}: mean return {mean_return:.1f} (random policy {baseline:.1f}) after "
          f"{received:,} env steps in {wall:.0f} s ({received / max(wall, 1e-9):,.0f} steps/s, {_transports(stats)})")  # fmt: skip
    print(f"[rlink demo] wrote {write_summary(args.out, summary)} and {plot_curve(args.out, curve, args.target_return)}")
    return {"target reached": 0, "interrupted": 130}.get(outcome, 2)


def _transports(stats: dict[str, Any]) -> str:
    chosen = sorted({a["transport"] for a in stats["actors"] + stats["ended_actors"]})
    return ",".join(chosen) if chosen else "-"


def _stop_actors(stop: Any, procs: list[Any], reports: Any, dataset: RLinkDataset) -> list[dict[str, Any]]:
    """Tell the actors to finish; keep draining the learner so none of them waits for credit."""
    stop.set()
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        with contextlib.suppress(Exception):  # draining: a timeout or a closed learner just means "no batch"
            dataset.fetch(timeout=0.2)
        while not reports.empty():
            got.append(reports.get())
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
    while len(got) < sum(1 for p in procs if p.exitcode == 0):
        try:
            got.append(reports.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: an actor died after exiting cleanly? count what came
            break
    return got


if __name__ == "__main__":
    import sys

    sys.exit(main())

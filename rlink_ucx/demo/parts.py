"""The pieces every learner process of ``rlink demo`` shares, with one learner (run.py) or
many learner ranks (ranks.py): the setup derived from the arguments, the actor processes,
progress values, and summary.json with the closing lines."""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing as mp
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import Config


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


class Setup:
    """What every learner process of the demo derives from the arguments before it starts."""

    def __init__(self, args: argparse.Namespace):
        from .actor import make_envs
        from .policy import space_spec

        probe = make_envs(args.env, 1)
        self.kind, self.n = space_spec(probe.single_action_space)
        self.obs_dim = int(np.prod(probe.single_observation_space.shape))
        probe.close()
        self.batch = per_rank_batch(args)
        # Small buffers keep the policy lag low: actors wait for credit instead of running ahead.
        step_bytes = trajectory_bytes(self.obs_dim, self.n, self.kind == "discrete", args.unroll)
        self.config = Config(frame_bytes=args.envs_per_actor * step_bytes, buffer_bytes=3 * self.batch * step_bytes,
                             actor_window_bytes=2 * args.envs_per_actor * step_bytes)  # fmt: skip

    def model(self, device: str) -> Any:
        from .policy import ActorCritic

        return ActorCritic(self.obs_dim, (self.kind, self.n)).to(device)


def per_rank_batch(args: argparse.Namespace) -> int:
    """Trajectories per update on each learner rank: ``--batch`` split over ``--learners``, so
    the ranks together (DDP averages their gradients) update on the single learner's batch."""
    return max(1, int(args.batch) // int(args.learners))


def start_actors(args: argparse.Namespace, address: str) -> tuple[Any, Any, list[Any]]:
    """The actor processes, given ``address`` (the learner's, or rank 0's), started."""
    from .actor import StopFlag, run_actor

    ctx = mp.get_context("spawn")
    stop, reports = StopFlag(ctx), ctx.Queue()
    procs = [ctx.Process(target=run_actor, name=f"rlink-demo-actor-{i}",
                         args=(address, None, args.transport, args.env, args.envs_per_actor, args.unroll,
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
    return stop, reports, procs


def kill_one_actor(args: argparse.Namespace, procs: list[Any], elapsed: float) -> dict[str, Any] | None:
    """``--kill-one-actor-after``: SIGKILL the first actor, mid-stream, once; the run must carry on."""
    if args.kill_one_actor_after is None or elapsed <= args.kill_one_actor_after:
        return None
    procs[0].kill()
    return {"pid": procs[0].pid, "after_seconds": round(elapsed, 2)}


def progress_values(args: argparse.Namespace, stats: dict[str, Any], elapsed: float, mean_return: float,
                    episodes: int, version: int, env_steps: int) -> dict[str, Any]:  # fmt: skip
    return {
        "steps": env_steps, "steps_per_s": env_steps / max(elapsed, 1e-9), "transport": transports(stats),
        "mb_per_s": stats["total"]["bytes"] / max(elapsed, 1e-9) / 1e6, "mean_return": mean_return,
        "target": args.target_return, "episodes": episodes, "lag_mean": stats["staleness"]["mean"],
        "lag_max": stats["staleness"]["max"], "version": version,
        "actors": stats["connected_actors"], "lost": stats["lost_actors"], "elapsed": elapsed,
        "max_seconds": args.max_seconds,
    }  # fmt: skip


def summarize(args: argparse.Namespace, outcome: str, stats: dict[str, Any], wall: float, updates: int, episodes: int,
              returns: collections.deque[float], baseline: float, actor_reports: list[dict[str, Any]],
              killed: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """summary.json: ``stats`` is the learner's (with many ranks, theirs merged: see ranks.py)."""
    mean_return = float(np.mean(returns)) if returns else 0.0
    lost = [a for a in stats["ended_actors"] if a["state"] == "lost"]
    received = stats["total"]["steps"] * args.unroll
    return {
        "outcome": outcome,
        "target_reached": outcome == "target reached",
        "config": {k: v for k, v in vars(args).items()},
        "transport": transports(stats),
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
        "weights": {k: stats["weights"][k] for k in ("published", "fanouts", "streams", "streamed", "fanout_failures")},
        "actors_started": args.actors,
        "actors_reported": len(actor_reports),
        "lost_actors": [{"actor_id": a["actor_id"], "pid": a["pid"], "error": a["error"], "env_steps": a["steps"] * args.unroll}
                        for a in lost],
        "killed_on_purpose": killed,
    }


def report(args: argparse.Namespace, summary: dict[str, Any], curve: list[tuple[int, float, float]]) -> int:
    """The closing lines, summary.json and learning_curve.png; the exit code."""
    from .report import plot_curve, write_summary

    outcome, received, wall = summary["outcome"], summary["total_env_steps"], summary["wall_seconds"]
    print(f"[rlink demo] {outcome}: mean return {summary['final_mean_return_100']:.1f} (random policy "
          f"{summary['random_policy_return']:.1f}) after {received:,} env steps in {wall:.0f} s "
          f"({received / max(wall, 1e-9):,.0f} steps/s, {summary['transport']})")  # fmt: skip
    print(f"[rlink demo] wrote {write_summary(args.out, summary)} and {plot_curve(args.out, curve, args.target_return)}")
    return {"target reached": 0, "interrupted": 130}.get(outcome, 2)


def transports(stats: dict[str, Any]) -> str:
    chosen = sorted({a["transport"] for a in stats["actors"] + stats["ended_actors"]})
    return ",".join(chosen) if chosen else "-"


def stop_actors(stop: Any, procs: list[Any], reports: Any, drain: Callable[[], Any]) -> list[dict[str, Any]]:
    """Tell the actors to finish; keep draining the learner (``drain`` takes a batch or times
    out) so none of them waits for credit."""
    stop.set()
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        with contextlib.suppress(Exception):  # draining: a timeout or a closed learner just means "no batch"
            drain()
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

"""``rlink demo --learners N``: the PPO demo with DDP over N learner ranks that share the actors.

The ``rlink demo`` process is rank 0; it spawns ranks 1..N-1 and the actors. Every rank makes
``Learner(..., distributed=True)`` (rank 0's address is the one the actors are given; rank 0
places each actor on a rank), reads its own actors' trajectories from its own
``RLinkDataset`` (``--batch`` split over the ranks, so one update of all ranks sees the single
learner's batch), updates the model wrapped in ``DistributedDataParallel`` (gloo on CPU, NCCL
on CUDA: the backward averages the gradients over the ranks) and calls ``learner.publish()``.

The ranks move in lockstep: each round they gather one row each (rank 0's decision to stop
and its learning-rate fraction, whether the rank holds a batch, its counters, the returns of
the episodes its batch finished); they update together once every rank holds a batch. Rank 0
reports progress and writes summary.json and learning_curve.png; every rank writes
``rank<r>.json`` (its actors, steps and counters) to ``--out``. A rank process that dies, or
a round that waits more than ``COLLECTIVE_TIMEOUT``, ends the run: rank 0 stops the actors and
reports the outcome "a learner rank failed" (exit code 2) with its own counters only. Ctrl-C
reaches rank 0 only (the other ranks and the actors ignore it); it stops every rank at the next
round.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import math
import multiprocessing as mp
import os
import signal
import socket
import time
from typing import Any

from .. import Learner, RLinkDataset
from .. import TimeoutError as RLinkTimeout
from .parts import Setup, kill_one_actor, progress_values, random_return, report, start_actors, stop_actors, summarize

_STOP, _LR, _HAVE, _STEPS, _BYTES, _CONNECTED, _LOST = range(7)
_HEADER = 7  # the fields above, then the finished episodes' returns (NaN-padded)
COLLECTIVE_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rank_device(device: str, rank: int) -> str:
    """``cuda``/``cuda:K`` gives rank r the GPU ``r`` (modulo the GPUs there): NCCL wants one per rank."""
    if not device.startswith("cuda"):
        return device
    import torch

    return f"cuda:{rank % max(1, torch.cuda.device_count())}"


class RankTrainer:
    """One learner rank: its learner, dataset, DDP model and PPO, and the lockstep rounds."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, port: int):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from .ppo import PPO, PPOConfig

        self.args, self.rank, self.world = args, rank, world
        self.device = rank_device(args.device, rank)
        torch.manual_seed(args.seed)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
        torch.set_num_threads(1)
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        # A round takes well under a second: a rank silent for COLLECTIVE_TIMEOUT died or hangs.
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))  # fmt: skip
        # The collectives below carry this rank's row on the backend's device.
        self.collective_device = self.device if backend == "nccl" else "cpu"
        setup = Setup(args)
        self.batch = setup.batch
        # The rendezvous that names this job (rank 0's port 0 is found by it on this host).
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        self.learner = Learner("127.0.0.1:0", distributed=True, transport=args.transport, config=setup.config)
        self.dataset = RLinkDataset(self.learner, batch_size=setup.batch, device=self.device)
        self.model = setup.model(self.device)
        self.ddp = DistributedDataParallel(self.model, device_ids=[self.device] if backend == "nccl" else None)
        torch.manual_seed(args.seed + rank)  # each rank's own minibatch order
        self.ppo = PPO(self.model, PPOConfig(), net=self.ddp)
        self.learner.publish(self.model)
        self.pending: Any = None
        self.updates = 0
        self.width = _HEADER + setup.batch * args.unroll  # a trajectory of T steps ends at most T episodes

    def exchange(self, stop: bool = False, lr_fraction: float = 0.0) -> Any:
        """One round: fetch a batch unless one is held, then gather every rank's row (``[world, width]``)."""
        import torch
        import torch.distributed as dist

        if self.pending is None:
            with contextlib.suppress(RLinkTimeout):
                self.pending = self.dataset.fetch(timeout=0.5)
        stats = self.learner.stats()
        row = torch.full((self.width,), math.nan, dtype=torch.float64)
        row[:_HEADER] = torch.tensor([float(stop), lr_fraction, float(self.pending is not None),
                                      stats["total"]["steps"], stats["total"]["bytes"], stats["connected_actors"],
                                      stats["lost_actors"]], dtype=torch.float64)  # fmt: skip
        if self.pending is not None:
            finished = self.pending["ep_return"][self.pending["done"].bool()].double().cpu()
            row[_HEADER : _HEADER + len(finished)] = finished
        row = row.to(self.collective_device)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row)
        return torch.stack(rows).cpu()

    def update(self, table: Any) -> list[float] | None:
        """Train on the held batch if every rank holds one (rank 0's learning-rate fraction) and
        publish; the returns of the episodes the ranks' batches finished. None: not this round."""
        if not bool((table[:, _HAVE] == 1).all()):
            return None
        self.ppo.set_lr_fraction(float(table[0, _LR]))
        self.ppo.update(self.pending)
        self.pending = None
        self.updates += 1
        self.learner.publish(self.model)
        returns = table[:, _HEADER:].flatten()
        return [float(r) for r in returns[~returns.isnan()]]

    def drain(self, finished: bool) -> bool:
        """One round of the wind-down: take a batch (so no actor waits for credit), then rank 0's word."""
        import torch
        import torch.distributed as dist

        with contextlib.suppress(Exception):  # a timeout or a closed learner just means "no batch"
            self.dataset.fetch(timeout=0.2)
        flag = torch.tensor([float(finished)], dtype=torch.float64, device=self.collective_device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def close(self, together: bool = True) -> dict[str, Any]:
        """Write ``rank<r>.json``, wait for the other ranks to have written theirs (unless a rank
        failed: ``together=False``), close."""
        import torch.distributed as dist

        stats = self.learner.stats()
        mine = {"rank": self.rank, "world_size": self.learner.world_size, "address": self.learner.address,
                "batch_per_rank": self.batch, "updates": self.updates,
                # DDP keeps the replicas equal: the same sum on every rank
                "parameter_sum": float(sum(p.detach().double().sum().item() for p in self.model.parameters())),
                "actors": sorted(a["actor_id"] for a in stats["actors"] + stats["ended_actors"] if a["steps"]),
                "actors_now": stats["actors"],
                **{k: stats[k] for k in ("total", "version", "staleness", "weights", "ended_actors")}}  # fmt: skip
        with open(os.path.join(self.args.out, f"rank{self.rank}.json"), "w") as fh:
            json.dump(mine, fh, indent=2, default=str)
        if together:
            dist.barrier()
        self.learner.close()
        with contextlib.suppress(Exception):  # after a rank failed the group may be broken: gone either way
            dist.destroy_process_group()
        return mine


def run_rank(args: argparse.Namespace, rank: int, world: int, port: int) -> None:
    """A rank other than 0 (a spawned process): rounds until rank 0 says stop, then the wind-down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 handles Ctrl-C and tells the others
    trainer = RankTrainer(args, rank, world, port)
    while True:
        table = trainer.exchange()
        if bool(table[0, _STOP]):
            break
        trainer.update(table)
    while not trainer.drain(False):
        pass
    trainer.close()


def main(args: argparse.Namespace) -> int:
    """Rank 0: spawn the other ranks and the actors, train, report."""
    world, port = args.learners, free_port()
    ctx = mp.get_context("spawn")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the ranks start with SIGINT ignored
    try:
        ranks = [ctx.Process(target=run_rank, args=(args, r, world, port), name=f"rlink-demo-rank-{r}")
                 for r in range(1, world)]  # fmt: skip
        for p in ranks:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        return _rank_zero(args, world, port, ranks)
    finally:
        for p in ranks:
            p.join(60)
            if p.exitcode is None:
                p.kill()
                p.join(5)


def _rank_zero(args: argparse.Namespace, world: int, port: int, ranks: list[Any]) -> int:
    from .progress import Progress

    interrupted: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))  # checked between rounds
    try:
        trainer = RankTrainer(args, 0, world, port)
    finally:
        signal.signal(signal.SIGINT, previous)
    baseline = random_return(args.env)
    stop, reports, procs = start_actors(args, trainer.learner.address)
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    progress = Progress(plain=args.plain)
    returns: collections.deque[float] = collections.deque(maxlen=100)
    curve: list[tuple[int, float, float]] = []
    episodes = updates = 0
    killed: dict[str, Any] | None = None
    outcome = ""
    started = time.monotonic()
    try:
        while True:
            elapsed = time.monotonic() - started
            for p in ranks:
                if p.exitcode is not None:  # the round would wait for it until COLLECTIVE_TIMEOUT
                    raise RuntimeError(f"{p.name} exited with code {p.exitcode}")
            if not outcome and interrupted:
                outcome = "interrupted"
            elif not outcome and elapsed > args.max_seconds:
                outcome = "time limit"
            elif not outcome and all(p.exitcode is not None for p in procs):
                outcome = "every actor exited"
            table = trainer.exchange(stop=bool(outcome), lr_fraction=1.0 - elapsed / args.max_seconds)
            if outcome:
                break
            finished = trainer.update(table)
            if finished is None:
                continue
            returns.extend(finished)
            episodes += len(finished)
            updates += 1
            mean_return = sum(returns) / len(returns) if returns else 0.0
            elapsed = time.monotonic() - started
            stats = _merged_live(trainer.learner.stats(), table)
            env_steps = stats["total"]["steps"] * args.unroll
            if returns:
                curve.append((env_steps, round(elapsed, 3), mean_return))
            if killed is None and stats["connected_actors"] == len(procs):
                killed = kill_one_actor(args, procs, elapsed)
            progress.update(progress_values(args, stats, elapsed, mean_return, episodes, trainer.learner.version,
                                            env_steps))  # fmt: skip
            if len(returns) == returns.maxlen and mean_return >= args.target_return:
                outcome = "target reached"  # the others hear it next round
    except Exception as exc:  # noqa: BLE001 - a collective failed or timed out: a rank died; stop the actors, report
        outcome = f"a learner rank failed: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        progress.close()
        signal.signal(signal.SIGINT, previous)
    wall = time.monotonic() - started
    together = not outcome.startswith("a learner rank failed")
    actor_reports = stop_actors(stop, procs, reports,
                                (lambda: trainer.drain(False)) if together else _local_drain(trainer))  # fmt: skip
    if together:
        trainer.drain(True)
    mine = trainer.close(together)
    per_rank = [mine] + ([_read_rank(args.out, r) for r in range(1, world)] if together else [])
    summary = summarize(args, outcome, merge_ranks(per_rank), wall, updates, episodes, returns, baseline,
                        actor_reports, killed)  # fmt: skip
    summary["ranks"] = [{"rank": r["rank"], "address": r["address"], "actors": r["actors"],
                         "env_steps": r["total"]["steps"] * args.unroll, "batch_per_rank": r["batch_per_rank"],
                         "version": r["version"]} for r in per_rank]  # fmt: skip
    return report(args, summary, curve)


def _local_drain(trainer: RankTrainer) -> Any:
    def drain() -> None:
        with contextlib.suppress(Exception):
            trainer.dataset.fetch(timeout=0.2)

    return drain


def _merged_live(stats: dict[str, Any], table: Any) -> dict[str, Any]:
    """Rank 0's stats with the counters of every rank (from this round's rows) for the progress line."""
    return {**stats, "total": {"steps": int(table[:, _STEPS].sum()), "bytes": int(table[:, _BYTES].sum())},
            "connected_actors": int(table[:, _CONNECTED].sum()), "lost_actors": int(table[:, _LOST].sum())}  # fmt: skip


def _read_rank(out: str, rank: int) -> dict[str, Any]:
    with open(os.path.join(out, f"rank{rank}.json")) as fh:
        got: dict[str, Any] = json.load(fh)
        return got


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' stats as one learner's: counters summed, staleness weighted by steps, the
    version and what was published as rank 0 has them (every rank publishes the same)."""
    steps = [r["total"]["steps"] for r in per_rank]
    lag = sum(r["staleness"]["mean"] * n for r, n in zip(per_rank, steps)) / max(1, sum(steps))
    weights = {k: sum(r["weights"][k] for r in per_rank) for k in ("fanouts", "streams", "streamed", "fanout_failures")}
    return {
        "total": {"steps": sum(steps), "bytes": sum(r["total"]["bytes"] for r in per_rank)},
        "version": per_rank[0]["version"],
        "staleness": {"mean": lag, "max": max(r["staleness"]["max"] for r in per_rank)},
        "weights": {"published": per_rank[0]["weights"]["published"], **weights},
        "actors": [a for r in per_rank for a in r["actors_now"]],
        "ended_actors": [a for r in per_rank for a in r["ended_actors"]],
    }

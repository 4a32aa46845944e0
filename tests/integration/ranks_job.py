"""One learner rank of a job of many, as the multi-learner tests start it (under torchrun, or
as a process given RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun would set them).

Each rank makes ``Learner(address, distributed=True)``; rank 0 writes its address to
``<out>/address``. Every rank appends each step it fetches to ``<out>/rank<r>.steps`` as
``actor seq value`` lines, flushed per batch (a killed rank's deliveries stay on record),
publishes ``--versions`` versions, and at the end writes ``<out>/rank<r>.json``.

rlink makes no process group: with ``--gloo`` the script makes the job's own (the default
group, gloo) before its learner, and the ranks publish in lockstep as DDP steps (a barrier
before each); without it the job needs no torch at all (numpy batches and weights; ``--no-torch`` runs the
rank as if torch were not installed). Once its
learner listens, each rank writes ``<out>/rank<r>.started.json``: its pid, the TCP sockets the
process listened on before and after the learner started, and the learner's port."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--address", default="127.0.0.1:0")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--seconds", type=float, default=90.0, help="give up after this long")
    p.add_argument("--replay", default=None, help="keep steps in a ReplayDataset, save it here and load it back")
    p.add_argument("--gloo", action="store_true", help="the job makes its own default process group (gloo)")
    p.add_argument("--nofile", type=int, default=0, help="RLIMIT_NOFILE of this rank (0: as inherited)")
    p.add_argument("--no-torch", action="store_true", help="run as if torch were not installed")
    p.add_argument("--publish-every", type=float, default=0.3, help="seconds between versions")
    args = p.parse_args(argv)
    if args.no_torch:
        sys.modules["torch"] = None  # type: ignore[assignment]  # every `import torch` raises ImportError
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    import resource

    import numpy as np

    from rlink_ucx import Closed, Config, Learner, RLinkDataset
    from rlink_ucx import TimeoutError as RLinkTimeout
    from rlink_ucx.bench.procfs import listening_sockets

    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    if args.gloo:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    config = Config(reconnect_timeout=20.0)
    started = time.monotonic()
    before = sorted(listening_sockets())
    with Learner(args.address, distributed=True, transport=args.transport, config=config) as learner:
        rank = learner.rank
        tmp = os.path.join(args.out, f"rank{rank}.started.tmp")
        with open(tmp, "w") as fh:
            json.dump({"pid": os.getpid(), "before": before, "after": sorted(listening_sockets()),
                       "port": learner.port}, fh)  # fmt: skip
        os.replace(tmp, os.path.join(args.out, f"rank{rank}.started.json"))  # whole, for a reader polling for it
        if rank == 0:
            tmp = os.path.join(args.out, "address.tmp")
            with open(tmp, "w") as fh:
                fh.write(learner.address)
            os.replace(tmp, os.path.join(args.out, "address"))
        if args.replay:
            summary = _replay_round_trip(learner, args)
            with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
                json.dump(summary, fh)
            return 0
        dataset = RLinkDataset(learner, batch_size=16, stop_when_actors_done=True,
                               format="torch" if args.gloo else "numpy")  # fmt: skip
        steps = open(os.path.join(args.out, f"rank{rank}.steps"), "w")
        published: list[int] = []
        fetched, last_publish = 0, 0.0
        placement = None
        while time.monotonic() - started < args.seconds:
            go = os.path.exists(os.path.join(args.out, "go"))  # every actor connected and subscribed
            if go and placement is None:  # rank 0's view of the ranks while every one lives
                placement = learner.stats().get("ranks")
            if go and len(published) < args.versions and time.monotonic() - last_publish > args.publish_every:
                _barrier()  # the ranks publish in lockstep, as DDP steps
                weights = _tensor(np.full(4, len(published) + 1, np.float32))
                published.append(learner.publish({"w": weights}, wait=True, timeout=30))
                last_publish = time.monotonic()
            try:
                batch = dataset.fetch(timeout=0.5)
            except RLinkTimeout:
                continue
            except Closed:  # this rank's actors are done
                break
            rows = zip(batch.actor_id.tolist(), batch.seq.tolist(), batch["x"][:, 0].tolist())
            steps.write("".join(f"{a} {s} {int(x)}\n" for a, s, x in rows))
            steps.flush()
            fetched += len(batch.seq)
        while len(published) < args.versions:  # the other ranks still wait at their barriers
            _barrier()
            published.append(learner.publish({"w": _tensor(np.full(4, len(published) + 1, np.float32))}))
        steps.close()
        stats = learner.stats()
        summary = {"rank": rank, "world_size": learner.world_size, "published": published, "fetched": fetched,
                   "actors": sorted(a["actor_id"] for a in stats["actors"] + stats["ended_actors"]),
                   "version": learner.version, "ranks": placement, "address": learner.address,
                   "torch_loaded": sys.modules.get("torch") is not None}  # fmt: skip
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(summary, fh)
    return 0


def _replay_round_trip(learner, args) -> dict:
    """Take this rank's actors' steps into a replay until they are done, save it under
    ``args.replay`` (each rank its own), load it back beside, and say what each held."""
    from rlink_ucx import ReplayDataset

    replay = ReplayDataset(learner, capacity=100_000, batch_size=8, prefetch=0)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        stats = learner.stats()
        if stats["ended_actors"] and not stats["actors"] and len(replay) == stats["total"]["steps"]:
            break
        time.sleep(0.1)
    held = len(replay)
    batch = replay.sample(timeout=10)
    mine = {a["actor_id"] for a in learner.stats()["ended_actors"]}
    assert set(batch.actor_id.tolist()) <= mine, "a rank samples only its own actors' steps"
    replay.save(args.replay)
    replay.close()
    _barrier()  # every rank saved (with the job's own group; else each rank reads back its own only)
    again = ReplayDataset.load(args.replay, learner, prefetch=0)
    summary = {"rank": learner.rank, "held": held, "loaded": len(again), "actors": sorted(mine)}
    again.close()
    return summary


def _barrier() -> None:
    """The job's own barrier, where the job made a process group (rlink makes none)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.barrier()


def _tensor(array):
    if "torch.distributed" not in sys.modules:  # a job without torch: numpy weights
        return array
    import torch

    return torch.from_numpy(array)


if __name__ == "__main__":
    sys.exit(main())

"""Deployment entry for launchers that start one command on every rank (torchrun, srun):
rank 0 runs the learner (learner.py), every other rank an actor (actor.py).

Rank and world size come from ``RANK``/``WORLD_SIZE`` (torchrun), else ``SLURM_PROCID``/
``SLURM_NTASKS`` (srun). The learner's address is ``RLINK_ADDRESS`` when set, else
``MASTER_ADDR`` (torchrun: the host of rank 0), else the first host of ``SLURM_JOB_NODELIST``
(``scontrol show hostnames``, or the expansion below where scontrol is absent), with port
``RLINK_PORT`` (8443; not ``MASTER_PORT``, which torchrun's own rendezvous holds). The learner
listens on ``RLINK_LISTEN`` (default ``0.0.0.0:<port>``), so every rank needs the same token:
``RLINK_TOKEN`` or ``RLINK_TOKEN_FILE``.

    torchrun --standalone --nproc-per-node 4 examples/deploy/launch.py --steps 10000
    python examples/deploy/launch.py --first-host      # the learner's host, for job scripts

Many learners: with ``RLINK_LEARNERS=N`` the first N ranks are learner ranks
(``learner.py --distributed``: ``Learner(distributed=True)``), the others actors. The launcher's
process group spans every rank, actors included, so the learner ranks make a group of their own
before the learner starts: ``torch.distributed.init_process_group`` (gloo here; a training job
uses nccl) over ``tcp://<rank 0's host>:RLINK_GROUP_PORT`` (default the learner's port + 1),
with rank = this rank and world size N. It becomes the default group, which DDP and
``Learner(distributed=True)`` use. Rank 0 of the job is learner rank 0, the address actors know.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # learner.py and actor.py beside this file

import actor
import learner


def split_top_level(nodelist: str) -> list[str]:
    """``"a[1-2],b"`` -> ``["a[1-2]", "b"]``: commas inside brackets do not split."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list, expanded as ``scontrol show hostnames`` does:
    ``"gpu[01-03,07],login1"`` -> gpu01, gpu02, gpu03, gpu07, login1 (zero padding kept)."""
    hosts: list[str] = []
    for item in split_top_level(nodelist):
        match = re.search(r"\[([^\]]*)\]", item)
        if match is None:
            hosts.append(item)
            continue
        head, tail = item[: match.start()], item[match.end():]
        for part in match.group(1).split(","):
            lo, _, hi = part.partition("-")
            width = len(lo) if lo.startswith("0") else 0
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.extend(expand_nodelist(f"{head}{n:0{width}d}{tail}"))  # a later [...] in tail
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol`` where it exists, else :func:`expand_nodelist`."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()  # fmt: skip
        if out:
            return out[0]
    return expand_nodelist(nodelist)[0]


def rank_and_world(env: dict[str, str]) -> tuple[int, int]:
    for rank, world in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if env.get(rank) is not None and env.get(world) is not None:
            return int(env[rank]), int(env[world])
    raise SystemExit("launch.py: no rank: run it under torchrun (RANK, WORLD_SIZE) or srun (SLURM_PROCID, SLURM_NTASKS)")


def learner_address(env: dict[str, str]) -> str:
    if env.get("RLINK_ADDRESS"):
        return env["RLINK_ADDRESS"]
    port = env.get("RLINK_PORT", "8443")
    if env.get("MASTER_ADDR"):
        return f"{env['MASTER_ADDR']}:{port}"
    if env.get("SLURM_JOB_NODELIST"):
        return f"{first_host(env['SLURM_JOB_NODELIST'])}:{port}"
    raise SystemExit("launch.py: no learner address: set RLINK_ADDRESS, MASTER_ADDR or SLURM_JOB_NODELIST")


def learner_count(env: dict[str, str], world: int) -> int:
    """``RLINK_LEARNERS`` (default 1): how many of the first ranks are learners; at least one rank is left for actors."""
    try:
        learners = int(env.get("RLINK_LEARNERS") or 1)
    except ValueError:
        raise SystemExit(f"launch.py: RLINK_LEARNERS={env['RLINK_LEARNERS']!r} is not a number") from None
    if not 1 <= learners < world:
        raise SystemExit(f"launch.py: RLINK_LEARNERS={learners} of {world} ranks: at least 1, and fewer than the ranks "
                         "(the rest are actors)")  # fmt: skip
    return learners


def learner_group(env: dict[str, str], address: str, rank: int, learners: int) -> str:
    """Make the learner ranks' own default process group; its rendezvous address."""
    import datetime

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    # Under torchrun, init_process_group would meet the agent's store (on MASTER_PORT) instead of
    # making one for this group: the learner ranks' group is not torchrun's.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    where = f"tcp://{host}:{env.get('RLINK_GROUP_PORT') or int(port) + 1}"
    dist.init_process_group("gloo", init_method=where, rank=rank, world_size=learners,
                            timeout=datetime.timedelta(seconds=float(env.get("RLINK_GROUP_TIMEOUT", "300"))))  # fmt: skip
    os.environ.setdefault("MASTER_ADDR", host.strip("[]"))  # where the other learner ranks reach rank 0
    return where


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10_000, help="steps per actor (0: stream until stopped)")
    p.add_argument("--summary", default=None, help="rank 0: write the learner's JSON summary here")
    p.add_argument("--first-host", action="store_true", help="print the first host of SLURM_JOB_NODELIST and exit")
    args = p.parse_args(argv)
    env = dict(os.environ)
    if args.first_host:
        print(first_host(env["SLURM_JOB_NODELIST"]))
        return 0
    rank, world = rank_and_world(env)
    address = learner_address(env)
    port = address.rsplit(":", 1)[1]
    learners = learner_count(env, world)
    if rank < learners:
        listen = ["--listen", env.get("RLINK_LISTEN", f"0.0.0.0:{port}"), "--expect-steps", str(args.steps * (world - learners))]
        if learners == 1:
            print(f"rank 0 of {world}: learner for {world - 1} actors at {address}", flush=True)
            return learner.run(learner.parse(listen + (["--summary", args.summary] if args.summary else [])))
        where = learner_group(env, address, rank, learners)
        print(f"rank {rank} of {world}: learner rank {rank} of {learners} (group {where}) for {world - learners} actors "
              f"at {address}", flush=True)  # fmt: skip
        listen += ["--distributed", "--batch-size", str(learner.batch_size_for(args.steps, 256))]  # divides each rank's share
        return learner.run(learner.parse(listen + (["--summary", args.summary] if args.summary else [])))
    for name in ("RLINK_RANK_TOKEN", "RLINK_RANK_TOKEN_FILE"):  # the learner ranks' secret: not an actor's
        os.environ.pop(name, None)
    return actor.run(actor.parse(["--address", address, "--actor-id", str(rank), "--steps", str(args.steps)]))


if __name__ == "__main__":
    sys.exit(main())

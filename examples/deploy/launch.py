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
    if rank == 0:
        print(f"rank 0 of {world}: learner for {world - 1} actors at {address}", flush=True)
        largs = learner.parse(["--listen", env.get("RLINK_LISTEN", f"0.0.0.0:{port}"),
                               "--expect-steps", str(args.steps * (world - 1))]
                              + (["--summary", args.summary] if args.summary else []))  # fmt: skip
        return learner.run(largs)
    return actor.run(actor.parse(["--address", address, "--actor-id", str(rank), "--steps", str(args.steps)]))


if __name__ == "__main__":
    sys.exit(main())

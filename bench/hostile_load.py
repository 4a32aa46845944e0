"""Hostile load: a learner under connection churn from another user on every port it listens on.

Starts, on loopback, a learner process with a metrics endpoint, ``--ucx`` actors over UCX and
``--tcp`` actors over TCP that put steps, and one actor that takes every weights version over its
own weights connection (``weights_shared_memory`` off, as an actor on another host). The learner
reads batches (counting the steps delivered) and publishes a 1 MiB model every second. Meanwhile
a process of another uid (``setpriv`` as 65534, no token) opens and closes connections to every
TCP port the learner process listens on (found in /proc), at most ``--rate`` a second, some
sending a few junk bytes first, for ``--seconds``; it stops by itself. Every ``--sample``
seconds the learner's open files, RSS, steps delivered and versions are recorded.

Passes (exit 0) when the learner lived, its open files stayed within ``--fd-margin`` of the
first sample, every sample saw steps delivered, and the weights actor got versions to the end.
Needs root (for setpriv).

Usage: python bench/hostile_load.py [--seconds 120] [--rate 300] [--ucx 2] [--tcp 2]
       [--sample 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import time
from typing import Any

from rlink_ucx.bench.procfs import listening_ports

SPAWN = mp.get_context("spawn")
TOKEN = "hostile-load-token-0123456789abcdef"
NOBODY = 65534

# Runs as another uid under the system python: connects to each port in turn, loopback only,
# at most ``rate`` connections a second, for ``seconds`` or until ``limit`` were tried (0: no
# limit); every third one sends junk first. A try not accepted within 0.25 s counts as failed
# (a full listen backlog drops the SYN; the kernel would resend it after 1 s).
CHURN = r"""
import json, socket, sys, time
ports = [int(p) for p in sys.argv[1].split(",")]
seconds, rate, limit = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
made, failed = dict.fromkeys(ports, 0), dict.fromkeys(ports, 0)
start = time.monotonic()
while time.monotonic() - start < seconds and not 0 < limit <= sum(made.values()) + sum(failed.values()):
    for port in ports:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=0.25)
            if made[port] % 3 == 0:
                s.sendall(b"\x00\x00\x01\x00 not a peer\r\n\r\n")
            s.close()
            made[port] += 1
        except OSError:
            failed[port] += 1
        behind = (sum(made.values()) + sum(failed.values())) / rate - (time.monotonic() - start)
        if behind > 0:
            time.sleep(behind)
print(json.dumps({"connections": sum(made.values()), "failed": sum(failed.values()), "per_port": made,
                  "failed_per_port": failed, "seconds": round(time.monotonic() - start, 1)}))
"""


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def churn(ports: list[int], seconds: float, rate: float, limit: int = 0) -> subprocess.Popen[str]:
    """Start the churn as uid 65534 (it prints a JSON summary when it stops)."""
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
                             "-c", CHURN, ",".join(map(str, ports)), str(seconds), str(rate), str(limit)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


# --- the processes ---------------------------------------------------------------------------
def learner_proc(info: Any, steps: Any, version: Any, stop: Any, nofile: int, publish_every: float, actors: int) -> None:
    """A learner with a metrics endpoint: counts the steps it delivers, publishes a 1 MiB
    model every ``publish_every`` seconds (its number into ``version``); once ``actors`` are
    connected, reports their data planes."""
    import torch

    from rlink_ucx import Config, Learner, RLinkDataset, RLinkError

    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    config = Config(max_connections=64, weights_shared_memory=False)
    with Learner("127.0.0.1:0", token=TOKEN, config=config, metrics_port=0) as learner:
        info.put({"address": learner.address, "metrics": learner.metrics_address, "pid": os.getpid()})
        dataset = RLinkDataset(learner, batch_size=64)
        last = 0.0
        told = False
        while not stop.is_set():
            if not told and len(learner.stats()["actors"]) >= actors:
                info.put(sorted(a["transport"] for a in learner.stats()["actors"]))
                told = True
            try:
                batch = dataset.fetch(timeout=0.5)
                with steps.get_lock():
                    steps.value += len(batch.seq)
            except RLinkError:
                pass
            if time.monotonic() - last >= publish_every:
                last = time.monotonic()
                v = learner.publish({"w": torch.full((1 << 18,), float(version.value + 1))})
                version.value = v


def putting_actor(address: str, transport: str, stop: Any) -> None:
    """Puts small steps, paced (a 2-core machine shares them with everything else)."""
    import numpy as np

    from rlink_ucx import Actor

    with Actor(address, token=TOKEN, transport=transport) as actor:
        obs = np.zeros(16, dtype=np.float32)
        while not stop.is_set():
            for _ in range(50):
                actor.put({"obs": obs})
            time.sleep(0.02)


def weights_actor(address: str, version: Any, stop: Any) -> None:
    """Takes every version over its own weights connection; its newest into ``version``."""
    from rlink_ucx import Actor, Config, RLinkError

    config = Config(weights_shared_memory=False)
    with Actor(address, token=TOKEN, transport="tcp", subscribe=True, config=config) as actor:
        while not stop.is_set():
            try:
                state, v = actor.get_remote_model(timeout=2, latest=False)  # ({}, 0): none here yet
                if v and int(state["w"][0]) != v:  # every value of version v is v
                    raise SystemExit(f"version {v} arrived with {float(state['w'][0])}")
                version.value = v
            except RLinkError:
                pass
            time.sleep(0.05)


# --- the run ---------------------------------------------------------------------------------
def run(seconds: float, rate: float, ucx: int, tcp: int, sample: float, fd_margin: int, nofile: int = 0,
        publish_every: float = 1.0, limit: int = 0) -> dict[str, Any]:  # fmt: skip
    steps, version, got = SPAWN.Value("q", 0), SPAWN.Value("q", 0), SPAWN.Value("q", 0)
    info, stop = SPAWN.Queue(), SPAWN.Event()
    learner = SPAWN.Process(target=learner_proc, args=(info, steps, version, stop, nofile, publish_every, ucx + tcp + 1))
    learner.start()
    procs: list[Any] = []
    try:
        where = info.get(timeout=60)
        pid = where["pid"]
        procs = [SPAWN.Process(target=putting_actor, args=(where["address"], t, stop))
                 for t in ["ucx"] * ucx + ["tcp"] * tcp]  # fmt: skip
        procs.append(SPAWN.Process(target=weights_actor, args=(where["address"], got, stop)))
        for p in procs:
            p.start()
        transports = info.get(timeout=90)
        deadline = time.monotonic() + 90
        while (steps.value == 0 or got.value == 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # every connection made: the baseline is the steady state
        ports = listening_ports(pid)
        weights_actor_ports = listening_ports(procs[-1].pid)  # it takes versions and listens nowhere
        rows = [_sample(0.0, pid, steps, version, got)]
        churner = churn(ports, seconds, rate, limit)
        started = time.monotonic()
        while churner.poll() is None and learner.is_alive():
            time.sleep(min(sample, max(0.1, started + len(rows) * sample - time.monotonic())))
            if time.monotonic() - started >= len(rows) * sample - 0.05 and learner.is_alive():
                rows.append(_sample(time.monotonic() - started, pid, steps, version, got))
        if churner.poll() is None:
            churner.kill()
        out, _ = churner.communicate(timeout=30)
        alive = learner.is_alive()
        if alive:
            time.sleep(min(3.0, 3 * publish_every))  # the next version, after the churn
            rows.append(_sample(time.monotonic() - started, pid, steps, version, got))
        report = _verdict(rows, ports, json.loads(out or "{}"), alive, fd_margin, learner.exitcode)
        names = {int(where["address"].rsplit(":", 1)[1]): "control", int(where["metrics"].rsplit(":", 1)[1]): "metrics"}
        return {"transports": transports, "weights_actor_ports": weights_actor_ports, "port_names": {p: names.get(p, "other") for p in ports}, **report}
    finally:
        stop.set()
        for p in [*procs, learner]:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def _sample(t: float, pid: int, steps: Any, version: Any, got: Any) -> dict[str, Any]:
    return {"t": round(t, 1), "open_files": open_files(pid), "rss_mib": rss_mib(pid), "steps": steps.value,
            "published": version.value, "actor_version": got.value}  # fmt: skip


def _verdict(rows: list[dict[str, Any]], ports: list[int], churned: dict[str, Any], alive: bool, fd_margin: int,
             exitcode: int | None) -> dict[str, Any]:  # fmt: skip
    base = rows[0]["open_files"]
    problems = []
    if not alive:
        problems.append(f"the learner died (exit code {exitcode})")
    if max(r["open_files"] for r in rows) - base > fd_margin:
        problems.append(f"open files grew from {base} to {max(r['open_files'] for r in rows)}")
    stalled = [r["t"] for a, r in itertools.pairwise(rows) if r["steps"] <= a["steps"]]
    if stalled:
        problems.append(f"no steps delivered in the samples at {stalled} s")
    if alive and rows[-1]["actor_version"] <= rows[0]["actor_version"]:
        problems.append("the weights actor got no version during the churn")
    if alive and rows[-1]["actor_version"] < rows[-1]["published"] - 3:
        problems.append(f"the weights actor fell behind: {rows[-1]['actor_version']} of {rows[-1]['published']}")
    return {"ports": ports, "churn": churned, "rows": rows, "ok": not problems, "problems": problems}


def table(report: dict[str, Any]) -> str:
    lines = ["| t (s) | learner open files | learner RSS (MiB) | steps delivered | versions published | weights actor has |",
             "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['t']} | {r['open_files']} | {r['rss_mib']} | {r['steps']} | {r['published']} | "
                     f"{r['actor_version']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--rate", type=float, default=300, help="churned connections per second, at most")
    parser.add_argument("--ucx", type=int, default=2)
    parser.add_argument("--tcp", type=int, default=2)
    parser.add_argument("--sample", type=float, default=10)
    parser.add_argument("--fd-margin", type=int, default=16)
    parser.add_argument("--nofile", type=int, default=0, help="the learner's RLIMIT_NOFILE (0: as inherited)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root: the churn runs as another uid through setpriv", file=sys.stderr)
        return 2
    report = run(args.seconds, args.rate, args.ucx, args.tcp, args.sample, args.fd_margin, args.nofile)
    print(f"actors' data planes: {report['transports']}; ports churned: {report['port_names']}")
    print(f"churn: {report['churn']}")
    print(table(report))
    print("OK" if report["ok"] else "FAILED: " + "; ".join(report["problems"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

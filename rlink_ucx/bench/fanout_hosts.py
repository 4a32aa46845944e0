"""Weights to actors on many hosts: a star of streams against one copy per host, on shaped links.

``rlink bench --suite fanout --hosts H`` makes H+1 hosts on this machine (network namespaces
with their own host names, every link shaped to ``--mbit``, ``netns.py``): the learner on host
0, ``--actors-per-host`` actors on each other host. Each mode runs its own learner and actors:

- ``star``: every actor takes every version on a weights stream of its own (actors that cannot
  share copies, ``Config(weights_shared_memory=False)``; every actor before one copy per host);
- ``per-host``: one actor per host takes it from the learner, the others read its copy
  (``Config(weights_relay=False)``);
- ``relay``: as ``per-host``, but the hosts pass each version on along a chain, so the learner
  sends it about once (docs/weights.md);
- ``broadcast``: as ``per-host``, but the learner and the hosts' streamers form a
  torch.distributed group (gloo) and each version's bytes go by broadcast
  (``Config(weights_fanout="broadcast")`` on the learner and the actors; for trusted networks
  only, docs/weights.md). Timed once the group holds every host.

For each version after the first: the seconds from ``publish`` until every actor confirmed it
(``wait_published``), and the bytes the learner's link sent meanwhile, against the model's
bytes and against one raw TCP transfer of them over one link, timed in the same run. Every
actor checks every version it takes bit for bit. Needs root.

    rlink bench --suite fanout --hosts 8 [--actors-per-host 4] [--mb 8] [--mbit 400] [--versions 3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from .netns import Hosts, available

__all__ = ["build_parser", "main", "run"]

# -> the actors' weights_shared_memory, weights_relay, and weights_fanout="broadcast" (the learner's too)
MODES = {"star": "000", "per-host": "100", "relay": "110", "broadcast": "101"}


def _state(floats: int, version: int) -> dict[str, Any]:
    return {"w": np.full(floats, version, np.float32)}


def learner_main(device: str, floats: int, actors: int, versions: int, timeout: float, flags: str = "000",
                 hosts: int = 0) -> None:  # fmt: skip
    """On host 0: publish ``versions`` versions after the first, once ``actors`` subscribed (and,
    broadcasting, once the group holds ``hosts`` members); one JSON line per version (seconds
    until all confirmed, bytes sent on ``device``)."""
    from rlink_ucx import Config, Learner

    def sent() -> int:
        with open(f"/sys/class/net/{device}/statistics/tx_bytes") as f:
            return int(f.read())

    config = Config(weights_fanout="broadcast" if flags[2] == "1" else "relay")
    with Learner("0.0.0.0:0", transport="tcp", config=config) as learner:
        print(f"listening {learner.address.rsplit(':', 1)[1]}", flush=True)
        learner.publish(_state(floats, 1))
        deadline = time.monotonic() + timeout
        while sum(a["weights_version"] >= 1 for a in learner.stats()["actors"]) < actors:  # each has version 1
            if time.monotonic() > deadline:
                raise SystemExit(f"only {learner.stats()['connected_actors']} of {actors} actors came")
            time.sleep(0.05)
        while flags[2] == "1" and learner.stats()["weights"]["broadcast"]["members"] < hosts:
            if time.monotonic() > deadline:
                raise SystemExit(f"the broadcast group never held {hosts} hosts: {learner.stats()['weights']['broadcast']}")
            time.sleep(0.05)
        for version in range(2, versions + 2):
            state = _state(floats, version)
            before, started = sent(), time.monotonic()
            learner.publish(state)
            confirmed = learner.wait_published(version, timeout=timeout)
            seconds = time.monotonic() - started
            print(json.dumps({"version": version, "seconds": seconds, "sent": sent() - before, "confirmed": confirmed,
                              "relay": learner.stats()["weights"]["relay"],
                              "broadcast": learner.stats()["weights"]["broadcast"]}), flush=True)  # fmt: skip
            time.sleep(0.2)  # let the peers' reads end before the next version's buffers


def actor_main(address: str, actor_id: int, flags: str, timeout: float) -> None:
    """On an actor host: take every version until the learner closes; one JSON line at the end."""
    from rlink_ucx import Actor, Closed, Config

    seen, exact = [], True
    config = Config(weights_shared_memory=flags[0] == "1", weights_relay=flags[1] == "1",
                    weights_fanout="broadcast" if flags[2] == "1" else "relay")  # fmt: skip
    with Actor(address, transport="tcp", actor_id=actor_id, config=config) as actor:
        version = 0
        try:
            while True:
                state, version = actor.get_remote_model(timeout=timeout, format="numpy", newer_than=version)
                exact = exact and bool(np.all(state["w"] == np.float32(version)))
                seen.append(version)
        except Closed:
            pass
        print(json.dumps({"actor": actor_id, "versions": seen, "exact": exact, "weights": actor.stats()["weights"]}),
              flush=True)  # fmt: skip


def _raw_transfer(hosts: Hosts, nbytes: int) -> float:
    """Seconds one TCP transfer of ``nbytes`` takes from host 0 to host 1."""
    code = ("import socket,sys,time;s=socket.create_server(('0.0.0.0',0));print(s.getsockname()[1],flush=True);"
            "c,_=s.accept();n=0\nwhile (d:=c.recv(1<<20)):n+=len(d)\nprint(n)")  # fmt: skip
    server = hosts.start(1, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    send = f"import socket;c=socket.create_connection(('{hosts.address(1)}',{port}));c.sendall(bytes({nbytes}));c.close()"
    started = time.monotonic()
    hosts.start(0, [sys.executable, "-c", send]).wait(120)
    got = int(server.communicate(timeout=120)[0])
    if got != nbytes:
        raise RuntimeError(f"raw transfer: {got} of {nbytes} bytes")
    return time.monotonic() - started


def _one_mode(hosts: Hosts, mode: str, per_host: int, floats: int, versions: int, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, RLINK_TOKEN=secrets.token_urlsafe(32), PYTHONPATH=os.pathsep.join(sys.path))
    me = [sys.executable, "-m", "rlink_ucx.bench.fanout_hosts"]
    learner = hosts.start(0, [*me, "--learner", hosts.device(0), str(floats), str(hosts.count * per_host),
                              str(versions), str(timeout), MODES[mode], str(hosts.count)], stdout=subprocess.PIPE,
                          text=True, env=env)  # fmt: skip
    actors: list[subprocess.Popen[Any]] = []
    try:
        assert learner.stdout is not None
        port = learner.stdout.readline().split()[-1]
        address = f"{hosts.address(0)}:{port}"
        for host in range(1, hosts.count + 1):
            actors += [hosts.start(host, [*me, "--actor", address, str(100 * host + i), MODES[mode], str(timeout)],
                                   stdout=subprocess.PIPE, text=True, env=env) for i in range(per_host)]  # fmt: skip
        rows = [json.loads(line) for line in learner.communicate(timeout=timeout * (versions + 2))[0].splitlines()]
        ends = [json.loads(a.communicate(timeout=timeout)[0].strip().splitlines()[-1]) for a in actors]
    finally:
        for proc in [learner, *actors]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    if learner.returncode != 0 or any(a.returncode != 0 for a in actors):
        raise RuntimeError(f"{mode}: the learner or an actor failed ({learner.returncode}, "
                           f"{[a.returncode for a in actors]})")  # fmt: skip
    return {"mode": mode, "versions": rows, "actors": ends}


def run(count: int, per_host: int, mb: float, mbit: float, versions: int, timeout: float = 120.0,
        modes: tuple[str, ...] = ("star", "per-host", "relay")) -> dict[str, Any]:  # fmt: skip
    """Each mode on one set of hosts; the raw transfer, timed first, is their yardstick."""
    why = available()
    if why:
        raise RuntimeError(f"rlink bench --suite fanout --hosts: {why}")
    floats = int(mb * (1 << 20)) // 4
    nbytes = floats * 4
    with Hosts(count, mbit) as hosts:
        raw = _raw_transfer(hosts, nbytes)
        results = [_one_mode(hosts, mode, per_host, floats, versions, timeout) for mode in modes]
    report: dict[str, Any] = {"hosts": count, "actors_per_host": per_host, "model_bytes": nbytes, "mbit": mbit,
                              "raw_transfer_seconds": raw, "modes": {}}  # fmt: skip
    for r in results:
        seconds = statistics.median(v["seconds"] for v in r["versions"])
        sent = statistics.median(v["sent"] for v in r["versions"])
        report["modes"][r["mode"]] = {
            "seconds": seconds, "x_raw_transfer": seconds / raw, "learner_bytes": sent, "x_model_bytes": sent / nbytes,
            "all_confirmed": all(v["confirmed"] for v in r["versions"]),
            "every_version_exact": all(a["exact"] and a["versions"][-1] == versions + 1 for a in r["actors"]),
            "per_version": [{"version": v["version"], "seconds": v["seconds"], "x_model_bytes": v["sent"] / nbytes,
                             "relay": v.get("relay")} for v in r["versions"]],
            "broadcast": r["versions"][-1].get("broadcast"),  # the learner's group, after the last version
            "actors": r["actors"],
        }  # fmt: skip
    return report


def _print(report: dict[str, Any]) -> None:
    print(f"fanout --hosts {report['hosts']}: {report['actors_per_host']} actors per host, "
          f"{report['model_bytes'] / (1 << 20):g} MiB model, links {report['mbit']} Mbit/s; "
          f"one raw transfer {report['raw_transfer_seconds']:.3f} s")  # fmt: skip
    print(f"{'mode':<10}{'s/version':>11}{'x raw':>8}{'learner MB':>12}{'x model':>9}  exact")
    for mode, m in report["modes"].items():
        print(f"{mode:<10}{m['seconds']:>11.3f}{m['x_raw_transfer']:>8.2f}{m['learner_bytes'] / 1e6:>12.2f}"
              f"{m['x_model_bytes']:>9.2f}  {m['every_version_exact'] and m['all_confirmed']}")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``rlink bench --suite fanout`` options (docs/cli.md is generated from them)."""
    parser = argparse.ArgumentParser(prog="rlink bench --suite fanout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--hosts", type=int, default=8, help="actor hosts (network namespaces)")
    parser.add_argument("--actors-per-host", type=int, default=4, help="actor processes on each host")
    parser.add_argument("--mb", type=float, default=8.0, help="model size, MiB")
    parser.add_argument("--mbit", type=float, default=400.0, help="every link's rate, Mbit/s")
    parser.add_argument("--versions", type=int, default=3, help="versions timed per mode")
    parser.add_argument("--modes", default="star,per-host,relay",
                        help="comma list of " + ", ".join(MODES) + " (broadcast: needs torch; trusted networks only)")
    parser.add_argument("--json", help="write the report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--learner"]:
        learner_main(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), float(argv[5]), argv[6], int(argv[7]))
        return 0
    if argv[:1] == ["--actor"]:
        actor_main(argv[1], int(argv[2]), argv[3], float(argv[4]))
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    report = run(args.hosts, args.actors_per_host, args.mb, args.mbit, args.versions, modes=modes)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

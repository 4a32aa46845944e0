"""The systems of ``rlink bench``, which rows a run measures, and how one row is run.

A system whose package is missing gets a row with ``"skipped"``; one that fails gets a row with
``"error"``: a failed row never loses the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from . import peers
from .common import installed
from .limits import run_memcpy, run_raw_socket
from .measure import Timing, record
from .rlink import run_rlink
from .workloads import Workload

MiB = 1 << 20
Runner = Callable[[Workload, Timing, int], dict[str, Any]]  # (workload, timing, actors) -> measured values

# What the command line sets for a run: --rlink-api, --ray-in-flight.
SETTINGS: dict[str, Any] = {"rlink_api": "auto", "ray_in_flight": 8}


@dataclasses.dataclass(frozen=True)
class System:
    key: str  # the name on the command line
    system: str  # the record's "system"
    transport: str
    group: str  # limits / rlink / peers
    requires: tuple[str, ...]
    run: Runner
    actors: tuple[int, ...] = (1,)
    harness: str | None = None  # a peer's module in bench/ (peers.py), absent from the wheel


def _one(run: Callable[[Workload, Timing], dict[str, Any]]) -> Runner:
    """A runner with one sender (the actor count is rlink's alone)."""
    return lambda w, t, a: run(w, t)


def _rlink(transport: str) -> Runner:
    return lambda w, t, a: run_rlink(w, t, transport, a, SETTINGS["rlink_api"])


def _peer(module: str, function: str, *extra: Any, actors: bool = False) -> Runner:
    """A peer's runner, ``function(workload, timing[, actors], *extra)`` of ``bench/<module>.py``,
    imported when the row runs (``run_one`` checked that the module is there)."""

    def run(w: Workload, t: Timing, a: int) -> dict[str, Any]:
        fn: Callable[..., dict[str, Any]] = getattr(peers.load(module), function)
        return fn(w, t, a, *extra) if actors else fn(w, t, *extra)

    return run


def _ray(w: Workload, t: Timing, actors: int) -> dict[str, Any]:
    return _peer("peer_ray", "run_ray", SETTINGS["ray_in_flight"])(w, t, actors)


SYSTEMS: dict[str, System] = {
    "memcpy": System("memcpy", "memcpy", "memory", "limits", (), _one(run_memcpy)),
    "raw-socket": System("raw-socket", "raw-socket", "tcp", "limits", (), run_raw_socket, (1, 4)),
    # The same, landing each message in the next slot of a 256 MiB buffer, as rlink's ring does.
    "raw-socket-ring": System("raw-socket-ring", "raw-socket-ring", "tcp", "limits", (),
                              lambda w, t, a: run_raw_socket(w, t, a, ring=True), (1, 4)),
    "rlink-tcp": System("rlink-tcp", "rlink", "tcp", "rlink", (), _rlink("tcp"), (1, 4)),
    "rlink-ucx": System("rlink-ucx", "rlink", "ucx", "rlink", ("ucxx",), _rlink("ucx"), (1, 4)),
    "rlink-shm": System("rlink-shm", "rlink", "shm", "rlink", (), _rlink("shm"), (1, 4)),
    "raw-ucxx": System("raw-ucxx", "raw-ucxx", "ucx", "peers", ("ucxx",), _peer("peer_ucxx", "run_raw_ucxx", actors=True),
                       (1, 4), harness="peer_ucxx"),
    "pyzmq-copy": System("pyzmq-copy", "pyzmq-copy", "tcp", "peers", ("zmq",), _peer("peer_zmq", "run_zmq", True),
                         harness="peer_zmq"),
    "pyzmq-zerocopy": System("pyzmq-zerocopy", "pyzmq-zerocopy", "tcp", "peers", ("zmq",),
                             _peer("peer_zmq", "run_zmq", False), harness="peer_zmq"),
    "torch-gloo": System("torch-gloo", "torch-gloo", "tcp", "peers", ("torch",), _peer("peer_gloo", "run_gloo"),
                         harness="peer_gloo"),
    "ray": System("ray", "ray", "ray", "peers", ("ray",), _ray, harness="peer_ray"),
}
FANOUT = "fanout"
# --quick: a few (workload, actors) per system, enough for every target; Ray last (its processes
# stay up until the end of the run).
QUICK: dict[str, list[tuple[str, int]]] = {
    "memcpy": [("64KiB", 1)],
    "raw-socket": [("1KiB", 1), ("64KiB", 1), ("atari", 1)],
    "rlink-tcp": [("1KiB", 1), ("64KiB", 1), ("atari", 1), ("64KiB", 4)],
    "rlink-ucx": [("64KiB", 1)],
    "rlink-shm": [("64KiB", 1), ("atari", 1)],
    "raw-ucxx": [("64KiB", 1)],
    "pyzmq-copy": [("atari", 1)],
    "pyzmq-zerocopy": [("atari", 1)],
    "torch-gloo": [("64KiB", 1)],
    "ray": [("atari", 1)],
}


def missing(system: System) -> str | None:
    if system.harness is not None and (reason := peers.missing(system.harness)) is not None:
        return reason
    if system.transport == "shm":
        from ..transport.shm import channel as shm

        if not shm.available():
            return "no memfd shared memory here (Linux only)"
    for module in system.requires:
        if not installed(module):
            return f"{module} not installed ({_install(module)})"
    return None


def _install(module: str) -> str:
    """The install command that brings ``module``: ucxx comes with the ucx extras, the peers with bench."""
    if module == "ucxx":
        from ..transport import UCX_INSTALL

        return UCX_INSTALL
    return "pip install 'rlink-ucx[bench]'"


def plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(system key, workload name, actors) in run order: by workload, Ray last."""
    keys = [k for k in args.systems if k != FANOUT]
    runs: list[tuple[str, str, int]] = []
    for key in keys:
        system = SYSTEMS[key]
        actors = [a for a in args.actors if a in system.actors] or [1]
        if args.quick:
            mine = [(w, a) for w, a in QUICK.get(key, []) if w in args.workloads and a in actors]
            mine = mine or [(args.workloads[0], actors[0])]
        else:
            mine = [(w, a) for w in args.workloads for a in actors]
        runs += [(key, w, a) for w, a in mine]
    order = {w: i for i, w in enumerate(args.workloads)}
    return sorted(runs, key=lambda r: (r[0] == "ray", order[r[1]], keys.index(r[0]), r[2]))


def run_one(key: str, workload: Workload, timing: Timing, actors: int) -> dict[str, Any]:
    system = SYSTEMS[key]
    base = (system.system, system.transport, workload, actors, system.group)
    reason = missing(system)
    if reason is not None:
        return record(*base, skipped=reason)
    try:
        return record(*base, **system.run(workload, timing, actors))
    except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
        where = f"{system.system}/{system.transport} {workload.name} x{actors}"
        print(f"  ! {where} failed:\n{traceback.format_exc(limit=-3)}", file=sys.stderr, flush=True)
        return record(*base, error=f"{type(exc).__name__}: {exc}"[:300])


def run_fanout(size_mb: int, subscribers: int, reps: int) -> list[dict[str, Any]]:
    nbytes = size_mb * MiB
    workload = Workload(f"fanout-{size_mb}MiB", (("params", "uint8", (nbytes,)),), kind="fanout")
    names = {"rlink-publish": "tcp", "plain-broadcast": "gloo"}
    try:
        if not installed("torch"):
            return [record(n, t, workload, subscribers, "fanout", skipped="torch not installed")
                    for n, t in names.items()]  # fmt: skip
        from . import fanout

        out = fanout.run(size_mb=size_mb, subscribers=subscribers, reps=reps)
    except Exception as exc:  # noqa: BLE001
        print(f"  ! fanout failed:\n{traceback.format_exc(limit=-4)}", file=sys.stderr, flush=True)
        why = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (a wait in the fan-out timed out)"
        return [record(n, t, workload, subscribers, "fanout", error=why[:300]) for n, t in names.items()]
    rows = []
    for name, transport in names.items():
        secs = out["seconds"][name]
        delivered = nbytes * subscribers  # bytes that reached receivers per publish
        rows.append(record(name, transport, workload, subscribers, "fanout",
                           gbps=delivered / statistics.median(secs) / 1e9, gbps_min=delivered / max(secs) / 1e9,
                           gbps_max=delivered / min(secs) / 1e9, per_s=1 / statistics.median(secs),
                           p50_us=float(np.percentile(secs, 50) * 1e6), p99_us=float(np.percentile(secs, 99) * 1e6),
                           reps=len(secs), paired_ratio=out["paired_ratio"]))  # fmt: skip
    return rows

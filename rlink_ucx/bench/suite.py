"""rlink against its limits and its peers, on the same workloads, in one run (issue 5).

Rows (all measured at the receiver, in separate processes unless noted):

- limits: ``memcpy`` (numpy copy of each chunk into preallocated arrays, one core, in this
  process); ``raw-socket`` (``sendmsg`` / ``recv_into`` a preallocated buffer);
- rlink: ``Actor.put`` (``put_many`` when ``--chunk`` > 1) -> ``RLinkDataset.fetch`` (batches of
  about 4 MiB) on each data plane (``tcp``, ``ucx``), with 1 and 4 actor processes;
- peers: ``raw-ucxx`` (ucxx low-level tag send/recv, the substrate of the ucx plane, on a
  worker made like rlink's), ``pyzmq-copy`` / ``pyzmq-zerocopy`` (PUSH/PULL multipart,
  ``copy=True`` / ``copy=False``), ``torch-gloo`` (ProcessGroupGloo send/recv per field),
  ``ray`` (a Ray actor receiving the arrays as ``.remote()`` arguments, at most 8 calls in
  flight; sender and receiver are Ray actors, started by Ray);
- ``fanout``: ``learner.publish`` vs one gloo broadcast (rlink_ucx/_bench_fanout.py).

Workloads: one uint8 array of 1 KiB / 64 KiB / 1 MiB / 16 MiB per step, an Atari step (obs
uint8[4,84,84], action int64, reward float32, done bool) and a CartPole step (obs float32[4],
...). Every system sends ``--chunk`` steps (default 1) per call, each with a ``t_ns`` int64
field stamped at the call; latency is receive time minus ``t_ns``.

Each (system, workload, actors) streams for warm-up + reps x window seconds; the first
``--warmup`` seconds are dropped, each window is one repetition; the median is reported with
min/max. A system whose package is missing gets a row with ``"skipped"``. See docs/bench-suite.md.

Usage: rlink bench [--quick] [--systems ...] [--workloads ...] [--rounds N] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import TimeoutError as FetchTimeout
from . import peers
from .common import BATCH_BYTES
from .peers import Receiver, Recorder, Sender, Timing, Workload, record

MiB = 1 << 20
MAX_BATCH_STEPS = 16384  # batches of about 4 MiB, at most this many steps (CartPole: 16384 steps, 0.6 MiB)


# --- rlink ---------------------------------------------------------------------------------------------
def rlink_config(workload: Workload) -> tuple[dict[str, int], int]:
    """Learner/actor config overrides and the batch size for ``workload``."""
    step = workload.wire_step_bytes
    batch = max(1, min(BATCH_BYTES // step, MAX_BATCH_STEPS))
    return {"buffer_bytes": max(64 * MiB, 16 * batch * step), "max_frame_bytes": max(64 * MiB, 2 * step)}, batch


class RlinkSender(Sender):
    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        from .. import Actor, Config

        super().__init__(info, workload, index, timeout)
        address, transport, overrides, self.batch, api = info
        self.api = api if api != "auto" else ("put" if workload.chunk == 1 else "put_many")
        self.key: Any = None
        self.step: dict[str, np.ndarray] = {}
        self.actor = Actor(address, transport=transport, config=Config.from_env(**overrides))

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        if self.api == "put_many":
            self.actor.put_many({"t_ns": t_ns, **arrays})
            return
        if self.key is not t_ns:  # one step's views (0-d for scalars), made once: t_ns is filled in place
            self.key = t_ns
            self.step = {name: a[0:1].reshape(a.shape[1:]) for name, a in {"t_ns": t_ns, **arrays}.items()}
        self.actor.put(self.step)

    def finish(self, marker: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        # A whole batch of markers, so the learner's last fetch completes; sent with the same calls
        # as the data (one put_many of the whole batch could exceed the learner's per-frame limit
        # when resending is off: see docs/bench-suite.md).
        for _ in range(-(-self.batch // self.workload.chunk)):
            self.send(marker, arrays)
        self.actor.flush(self.timeout)

    def close(self) -> None:
        self.actor.close()


class RlinkReceiver(Receiver):
    def __init__(self, workload: Workload, transport: str, timeout: float, api: str = "auto"):
        from .. import Config, Learner, RLinkDataset

        self.api = api
        self.overrides, self.batch = rlink_config(workload)
        self.transport = transport
        self.timeout = timeout
        self.learner = Learner("127.0.0.1:0", transport=transport, config=Config.from_env(**self.overrides))
        self.dataset = RLinkDataset(self.learner, batch_size=self.batch)
        self.seen: set[int] = set()

    def info(self) -> Any:
        return (self.learner.address, self.transport, self.overrides, self.batch, self.api)

    def recv(self, rec: Recorder) -> int:
        deadline = time.monotonic() + self.timeout
        while True:  # in slices, so a failed sender is noticed
            try:
                batch = self.dataset.fetch(timeout=min(2.0, max(0.01, deadline - time.monotonic())))
                break
            except FetchTimeout:
                self.check()
                if time.monotonic() > deadline:
                    raise
        now = time.monotonic_ns()
        t = batch["t_ns"].numpy()
        if not (t < 0).any():
            rec.add(now, len(t), now - t)
            return 0
        data = t >= 0
        new = set(batch.actor_id.numpy()[~data].tolist()) - self.seen
        self.seen |= new
        if data.any():
            rec.add(now, int(data.sum()), now - t[data])
        return len(new)

    def close(self) -> None:
        self.learner.close()


RLINK_API = {"api": "auto"}  # --rlink-api


def run_rlink(workload: Workload, timing: Timing, transport: str, actors: int) -> dict[str, Any]:
    receiver = RlinkReceiver(workload, transport, timing.timeout, RLINK_API["api"])
    return peers.run_session(receiver, f"{__name__}:RlinkSender", workload, timing, actors)


# --- systems ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class System:
    key: str  # the name on the command line
    system: str  # the record's "system"
    transport: str
    group: str  # limits / rlink / peers
    requires: tuple[str, ...]
    run: Callable[[Workload, Timing, int], dict[str, Any]]
    actors: tuple[int, ...] = (1,)


def _peer(name: str) -> Callable[[Workload, Timing, int], dict[str, Any]]:
    return lambda w, t, a: peers.RUNNERS[name](w, t)


SYSTEMS: dict[str, System] = {
    "memcpy": System("memcpy", "memcpy", "memory", "limits", (), _peer("memcpy")),
    "raw-socket": System("raw-socket", "raw-socket", "tcp", "limits", (), _peer("raw-socket")),
    "rlink-tcp": System("rlink-tcp", "rlink", "tcp", "rlink", (), lambda w, t, a: run_rlink(w, t, "tcp", a), (1, 4)),
    "rlink-ucx": System("rlink-ucx", "rlink", "ucx", "rlink", ("ucxx",), lambda w, t, a: run_rlink(w, t, "ucx", a),
                        (1, 4)),  # fmt: skip
    "rlink-shm": System("rlink-shm", "rlink", "shm", "rlink", (), lambda w, t, a: run_rlink(w, t, "shm", a), (1, 4)),
    "raw-ucxx": System("raw-ucxx", "raw-ucxx", "ucx", "peers", ("ucxx",), _peer("raw-ucxx")),
    "pyzmq-copy": System("pyzmq-copy", "pyzmq-copy", "tcp", "peers", ("zmq",), _peer("pyzmq-copy")),
    "pyzmq-zerocopy": System("pyzmq-zerocopy", "pyzmq-zerocopy", "tcp", "peers", ("zmq",), _peer("pyzmq-zerocopy")),
    "torch-gloo": System("torch-gloo", "torch-gloo", "tcp", "peers", ("torch",), _peer("torch-gloo")),
    "ray": System("ray", "ray", "ray", "peers", ("ray",), _peer("ray")),
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
TARGET_SIZES_RAW = ("64KiB", "1MiB", "16MiB")


def missing(system: System) -> str | None:
    if system.transport == "shm":
        from ..transport import shm

        if not shm.available():
            return "no memfd shared memory here (Linux only)"
    for module in system.requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{module} not installed"
    return None


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
        if importlib.util.find_spec("torch") is None:
            return [record(n, t, workload, subscribers, "fanout", skipped="torch not installed")
                    for n, t in names.items()]  # fmt: skip
        from . import fanout as _bench_fanout

        out = _bench_fanout.run(size_mb=size_mb, subscribers=subscribers, reps=reps)
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


def merge_rounds(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the rounds of one row: the windows of every round pooled."""
    ok = [r for r in recs if r.get("windows")]
    if len(recs) == 1 or not ok:
        return recs[0]
    out = dict(ok[0])
    windows = [w for r in ok for w in r["windows"]]
    scale = out["size_bytes"] / 1e9
    out.update(windows=windows, reps=len(windows), per_s=statistics.median(windows),
               gbps=statistics.median(windows) * scale, gbps_min=min(windows) * scale, gbps_max=max(windows) * scale,
               p50_us=statistics.median(r["p50_us"] for r in ok), p99_us=statistics.median(r["p99_us"] for r in ok),
               rounds=len(ok))  # fmt: skip
    for key in ("cpu_s_per_gb_send", "cpu_s_per_gb_recv"):
        values = [r[key] for r in ok if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    failed = [r.get("error") or r.get("skipped") for r in recs if not r.get("windows")]
    if failed:
        out["failed_rounds"] = failed
    return out


# --- targets -----------------------------------------------------------------------------------------------
def _find(records: list[dict[str, Any]], system: str, workload: str, actors: int | None = 1,
          transport: str | None = None) -> dict[str, Any] | None:  # fmt: skip
    rows = [r for r in records if r["system"] == system and r["workload"] == workload
            and (actors is None or r["actors"] == actors)
            and (transport is None or r["transport"] == transport) and r.get("per_s")]  # fmt: skip
    return max(rows, key=lambda r: r["per_s"]) if rows else None


def targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of issue 5, its measured ratio (None: not measured in this run) and verdict."""
    out = []

    def add(name: str, num: dict[str, Any] | None, den: dict[str, Any] | None, need: float, what: str,
            at_most: bool = False) -> None:  # fmt: skip
        ratio = num["per_s"] / den["per_s"] if num and den else None
        detail = ""
        if num and den:
            detail = f"{_label(num)} {_rate(num, what)} / {_label(den)} {_rate(den, what)}"
        met = None if ratio is None else (ratio <= need if at_most else ratio >= need)
        out.append({"target": name, "ratio": ratio, "need": need, "met": met,
                    "detail": detail or "not measured in this run"})  # fmt: skip

    for w in ("1KiB", *TARGET_SIZES_RAW):
        need = 0.5 if w == "1KiB" else 0.85
        add(f"rlink best plane >= {need}x raw socket, {w}", _find(records, "rlink", w), _find(records, "raw-socket", w),
            need, "gbps")  # fmt: skip
    atari = _find(records, "rlink", "atari")
    add("rlink >= 10x Ray, atari steps", atari, _find(records, "ray", "atari"), 10.0, "per_s")
    add("rlink >= 1.5x pyzmq-copy, atari steps", atari, _find(records, "pyzmq-copy", "atari"), 1.5, "per_s")
    for w in dict.fromkeys(r["workload"] for r in records if r["system"] == "rlink-publish"):
        # publish time / broadcast time = broadcast rate / publish rate
        add("rlink-publish time <= 1.25x plain broadcast", _find(records, "plain-broadcast", w, None),
            _find(records, "rlink-publish", w, None), 1.25, "per_s", at_most=True)  # fmt: skip
    workloads = list(dict.fromkeys(r["workload"] for r in records if r["system"] == "rlink"))
    for transport in ("tcp", "ucx", "shm"):
        for w in workloads:
            four = _find(records, "rlink", w, 4, transport)
            one = _find(records, "rlink", w, 1, transport)
            if four or one:
                add(f"rlink-{transport} 4 actors >= 0.8x 1 actor, {w}", four, one, 0.8, "per_s")
    return out


def _label(r: dict[str, Any]) -> str:
    label = r["system"] if r["system"] != "rlink" else f"rlink-{r['transport']}"
    return label + (f" x{r['actors']}" if r["actors"] != 1 else "")


def _rate(r: dict[str, Any], what: str) -> str:
    if r.get("group") == "fanout":
        return f"{1e3 / r['per_s']:,.0f} ms"
    return f"{r['gbps']:.2f} GB/s" if what == "gbps" else f"{r['per_s']:,.0f}/s"


# --- output ------------------------------------------------------------------------------------------------
def _fmt(v: Any, spec: str, width: int) -> str:
    if not isinstance(v, (int, float)):
        return f"{'-':>{width}}"
    if spec == ".2f" and v >= 100:  # CPU s/GB of tiny steps, Ray's 1000s
        spec = ",.0f"
    return f"{v:{width}{spec}}"


def print_table(records: list[dict[str, Any]], file: Any = None) -> None:
    file = file or sys.stdout
    head = (f"{'workload':<16}{'system':<16}{'plane':<7}{'act':>4}{'GB/s':>8}{'min':>7}{'max':>7}{'steps/s':>13}"
            f"{'p50 us':>10}{'p99 us':>10}{'cpu s/GB send':>15}{'recv':>8}")  # fmt: skip
    print(head, file=file)
    print("-" * len(head), file=file)
    for r in records:
        lead = f"{r['workload']:<16}{r['system']:<16}{r['transport']:<7}{r['actors']:>4}"
        if r.get("skipped") or r.get("error"):
            why = f"skipped: {r['skipped']}" if r.get("skipped") else f"error: {r['error']}"
            print(f"{lead}  {' '.join(why.split())[:150]}", file=file)
            continue
        print(f"{lead}{_fmt(r['gbps'], '.2f', 8)}{_fmt(r.get('gbps_min'), '.2f', 7)}{_fmt(r.get('gbps_max'), '.2f', 7)}"
              f"{_fmt(r['per_s'], ',.0f', 13)}{_fmt(r['p50_us'], ',.0f', 10)}{_fmt(r['p99_us'], ',.0f', 10)}"
              f"{_fmt(r.get('cpu_s_per_gb_send'), '.2f', 15)}{_fmt(r.get('cpu_s_per_gb_recv'), '.2f', 8)}",
              file=file)  # fmt: skip


def print_targets(results: list[dict[str, Any]], file: Any = None) -> None:
    file = file or sys.stdout
    print("\ntargets", file=file)
    if not results:
        print("  (none: this run measured no row that a target compares)", file=file)
    for t in results:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        ratio = f"{t['ratio']:.2f}" if t["ratio"] is not None else "-"
        print(f"  {t['target']:<48}{ratio:>7}  {verdict:<7}{t['detail']}", file=file)


def plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.get("gbps") and not r.get("skipped") and not r.get("error")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    sized = [r for r in ok if r["workload"] in ("1KiB", "64KiB", "1MiB", "16MiB")]
    colors = plt.get_cmap("tab20").colors
    every = list(dict.fromkeys(_label(r) for r in ok))
    color = {label: colors[(2 * i) % 20 + (2 * i) // 20] for i, label in enumerate(every)}
    for label in dict.fromkeys(_label(r) for r in sized):
        rows = sorted((r for r in sized if _label(r) == label), key=lambda r: r["size_bytes"])
        x = [r["size_bytes"] for r in rows]
        y = [r["gbps"] for r in rows]
        err = [[r["gbps"] - r.get("gbps_min", r["gbps"]) for r in rows],
               [r.get("gbps_max", r["gbps"]) - r["gbps"] for r in rows]]  # fmt: skip
        group = rows[0]["group"]
        style, marker = {"rlink": ("-", "o"), "limits": ("--", "s")}.get(group, (":", "^"))
        left.errorbar(x, y, yerr=err, marker=marker, linestyle=style, capsize=3, label=label, color=color[label],
                      linewidth=2.2 if group == "rlink" else 1.3)  # fmt: skip
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks([1 << 10, 64 << 10, 1 << 20, 16 << 20], ["1 KiB", "64 KiB", "1 MiB", "16 MiB"])
    left.set_xlabel("payload per step")
    left.set_ylabel("GB/s at the receiver (median, min-max)")
    left.set_title("throughput vs payload size")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7, ncol=2)
    rl = [r for r in ok if r["workload"] in ("atari", "cartpole")]
    labels = list(dict.fromkeys(_label(r) for r in rl))
    for i, w in enumerate(("atari", "cartpole")):
        vals = {_label(r): r["per_s"] for r in rl if r["workload"] == w}
        xs = [j + i * 0.4 for j, lab in enumerate(labels) if lab in vals]
        right.bar(xs, [vals[lab] for lab in labels if lab in vals], width=0.4, label=w,
                  color=("tab:blue", "tab:orange")[i])  # fmt: skip
    right.set_xticks([j + 0.2 for j in range(len(labels))], labels, rotation=60, ha="right", fontsize=7)
    right.set_yscale("log")
    right.set_ylabel("steps/s at the receiver")
    right.set_title("RL steps")
    right.grid(True, axis="y", which="both", alpha=0.3)
    if rl:
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(),
                            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "loadavg": _loadavg()}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True, text=True,
                             timeout=10).stdout.strip()  # fmt: skip
        if rev:
            info["git"] = rev
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# --- main ---------------------------------------------------------------------------------------------------
def _names(value: str, known: list[str], what: str) -> list[str]:
    aliases = {"1K": "1KiB", "64K": "64KiB", "1M": "1MiB", "16M": "16MiB"}
    out = [aliases.get(v.strip(), v.strip()) for v in value.split(",") if v.strip()]
    bad = [v for v in out if v not in known]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(known)})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlink bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a few rows per system, 1 short rep (< 60 s)")
    parser.add_argument("--systems", default=",".join([*SYSTEMS, FANOUT]), help="comma list (default: all)")
    parser.add_argument("--workloads", default=",".join(peers.WORKLOADS), help="comma list (default: all)")
    parser.add_argument("--actors", default="1,4", help="actor processes for rlink rows")
    parser.add_argument("--chunk", type=int, default=1, help="steps per send call, for every system")
    parser.add_argument("--reps", type=int, help="repetitions (windows) per row [3; --quick 1]")
    parser.add_argument("--warmup", type=float, help="seconds dropped at the start of each row [0.5; --quick 0.15]")
    parser.add_argument("--window", type=float, help="seconds per repetition [0.6; --quick 0.3]")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole plan this many times (interleaved) and pool the windows")
    parser.add_argument("--timeout", type=float, help="limit of any single wait, seconds [60; --quick 20]")
    parser.add_argument("--fanout-mb", type=int, help="fan-out state size [100; --quick 16]")
    parser.add_argument("--fanout-subscribers", type=int, default=3)
    parser.add_argument("--fanout-reps", type=int, help="[5; --quick 1]")
    parser.add_argument("--rlink-api", choices=["auto", "put", "put_many"], default="auto",
                        help="rlink actor call: auto = put for --chunk 1, else put_many")
    parser.add_argument("--ray-in-flight", type=int, default=8, help="pending .remote() calls per Ray sender")
    parser.add_argument("--json", help="write the records (a JSON list) here")
    parser.add_argument("--plot", help="write a PNG of throughput vs size here")
    args = parser.parse_args(argv)
    args.systems = _names(args.systems, [*SYSTEMS, FANOUT], "system")
    args.workloads = _names(args.workloads, list(peers.WORKLOADS), "workload")
    args.actors = [int(a) for a in args.actors.split(",")]
    quick = args.quick
    timing = Timing(warmup=args.warmup if args.warmup is not None else (0.15 if quick else 0.5),
                    window=args.window if args.window is not None else (0.3 if quick else 0.6),
                    reps=args.reps or (1 if quick else 3),
                    timeout=args.timeout or (20.0 if quick else 60.0))  # fmt: skip
    if args.chunk < 1:
        parser.error("--chunk must be >= 1")
    peers.RUNNERS["ray"] = lambda w, t: peers.run_ray(w, t, args.ray_in_flight)
    RLINK_API["api"] = args.rlink_api

    started = time.monotonic()
    info = machine()
    print(f"rlink bench: {info.get('cpus')} CPUs ({info.get('cpu', '?')}), python {info['python']}, "
          f"git {info.get('git', '?')}; {timing.reps} rep(s) of {timing.window}s after {timing.warmup}s warm-up, "
          f"chunk {args.chunk} step(s) per call; load average {info['loadavg']}", flush=True)  # fmt: skip
    records: list[dict[str, Any]] = []
    runs = plan(args)
    ray_runs = [r for r in runs if r[0] == "ray"]  # Ray's processes stay up once started: last
    runs = [r for r in runs if r[0] != "ray"] * args.rounds + ray_runs * args.rounds
    fanout_done = FANOUT not in args.systems
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    try:
        for i, (key, wname, actors) in enumerate(runs):
            if key == "ray" and not fanout_done:  # fan-out before Ray's processes start
                records += _fanout(args, quick)
                fanout_done = True
            workload = peers.WORKLOADS[wname].with_chunk(args.chunk)
            t0 = time.monotonic()
            rec = run_one(key, workload, timing, actors)
            rows.setdefault((key, wname, actors), []).append(rec)
            print(f"[{i + 1}/{len(runs)}] {wname:<9}{key:<15}x{actors}  " + _summary(rec)
                  + f"  ({time.monotonic() - t0:.1f}s)", flush=True)  # fmt: skip
        if not fanout_done:
            records += _fanout(args, quick)
    finally:
        peers.ray_shutdown()
    records += [merge_rounds(recs) for recs in rows.values()]
    order = {w: i for i, w in enumerate(args.workloads)}
    keys = [SYSTEMS[k].system for k in SYSTEMS]
    records.sort(key=lambda r: (order.get(r["workload"], len(order)), keys.index(r["system"]) if r["system"] in keys
                                else len(keys), r["transport"], r["actors"]))  # fmt: skip
    results = targets(records)
    print()
    print_table(records)
    print_targets(results)
    print(f"\ntotal {time.monotonic() - started:.0f}s; load average at the start {info['loadavg']}, "
          f"at the end {_loadavg()} (1, 5, 15 min; {info.get('cpus')} CPUs)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    if args.plot:
        plot(records, args.plot)
    return 0


def _fanout(args: argparse.Namespace, quick: bool) -> list[dict[str, Any]]:
    size = args.fanout_mb or (16 if quick else 100)
    reps = args.fanout_reps or (1 if quick else 5)
    t0 = time.monotonic()
    rows = run_fanout(size, args.fanout_subscribers, reps)
    for r in rows:
        print(f"[fanout] {r['workload']:<14}{r['system']:<16}  {_summary(r)}", flush=True)
    print(f"[fanout] ({time.monotonic() - t0:.1f}s)", flush=True)
    return rows


def _summary(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    if r.get("error"):
        return f"error: {r['error']}"
    return f"{r['gbps']:.2f} GB/s  {r['per_s']:,.0f}/s  p50 {r['p50_us']:,.0f} us  p99 {r['p99_us']:,.0f} us"


__all__ = ["main", "SYSTEMS", "targets"]

if __name__ == "__main__":
    sys.exit(main())

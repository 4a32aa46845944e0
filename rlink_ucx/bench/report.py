"""What a run of ``rlink bench`` reports: the targets and their verdicts, the table, the plot,
and the machine it ran on.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from typing import Any

from .common import SOURCE_ROOT

TARGET_SIZES_RAW = ("64KiB", "1MiB", "16MiB")


def _find(records: list[dict[str, Any]], system: str, workload: str, actors: int | None = 1,
          transport: str | None = None) -> dict[str, Any] | None:  # fmt: skip
    rows = [r for r in records if r["system"] == system and r["workload"] == workload
            and (actors is None or r["actors"] == actors)
            and (transport is None or r["transport"] == transport) and r.get("per_s")]  # fmt: skip
    return max(rows, key=lambda r: r["per_s"]) if rows else None


def targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of the suite (docs/bench-suite.md), its measured ratio (None: not measured in
    this run) and verdict."""
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
    for w in workloads:  # same host: shared memory must never lose to a socket (from 4 KiB up)
        shm, raw = _find(records, "rlink", w, 1, "shm"), _find(records, "raw-socket", w)
        if shm and raw and w not in ("1KiB", "cartpole"):
            add(f"rlink-shm >= 1.0x raw socket, {w}", shm, raw, 1.0, "gbps")
    for transport in ("tcp", "ucx", "shm"):
        for w in workloads:
            four = _find(records, "rlink", w, 4, transport)
            one = _find(records, "rlink", w, 1, transport)
            if four or one:
                add(f"rlink-{transport} 4 actors >= 0.8x 1 actor, {w}", four, one, 0.8, "per_s")
            raw4 = _find(records, "raw-socket", w, 4)
            if four and raw4:
                add(f"rlink-{transport} x4 >= 0.8x raw-socket x4, {w}", four, raw4, 0.8, "gbps")
            # The same against a receiver that keeps what it receives as rlink does (each
            # message in fresh memory of a ring, not one buffer that stays in the cache), and,
            # for ucx, against UCX itself with as many senders: what is left of the gap above
            # is the cost of keeping the data, or of the substrate.
            for base in ("raw-socket-ring", "raw-ucxx") if transport == "ucx" else ("raw-socket-ring",):
                base4 = _find(records, base, w, 4)
                if four and base4:
                    add(f"rlink-{transport} x4 >= 0.8x {base} x4, {w}", four, base4, 0.8, "gbps")
    return out


def _label(r: dict[str, Any]) -> str:
    label = r["system"] if r["system"] != "rlink" else f"rlink-{r['transport']}"
    return label + (f" x{r['actors']}" if r["actors"] != 1 else "")


def _rate(r: dict[str, Any], what: str) -> str:
    if r.get("group") == "fanout":
        return f"{1e3 / r['per_s']:,.0f} ms"
    return f"{r['gbps']:.2f} GB/s" if what == "gbps" else f"{r['per_s']:,.0f}/s"


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
    sized = [r for r in ok if r["workload"] in ("1KiB", "4KiB", "16KiB", "64KiB", "1MiB", "16MiB")]
    colors = plt.get_cmap("tab20")(range(20))  # its 20 colours, as RGBA rows
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


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(),
                            "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                            "loadavg": loadavg()}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        rev = subprocess.run(["git", "-C", SOURCE_ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()  # fmt: skip
        if rev:
            info["git"] = rev
    except (OSError, subprocess.SubprocessError):
        pass
    return info

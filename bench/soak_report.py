"""The soak at scale's report: one row per minute (the learner's resources, the latencies of the
steps fetched in it, the machine's CPU by whom, the learner's GC pauses), the drift of
resources and p99 over the run, the printed table and the plot (bench/soak_scale.py)."""

from __future__ import annotations

import itertools

import numpy as np


def per_minute(samples: list[dict], started: float, events: list[tuple[float, str]]) -> list[dict]:
    """One row per minute of the run: the learner's last RSS, fds and threads in it, the p50 and
    p99 of the steps fetched in it, and the events."""
    rows: dict[int, dict] = {}
    for s in samples:
        m = max(0, int((s["time"] - started) // 60))
        row = rows.setdefault(m, {"minute": m + 1, "lat": []})
        row.update(rss_mib=round(s["rss_mib"], 1), fds=s["fds"], threads=s["threads"], learner=s["learner"])
        row["load"] = max(row.get("load", 0.0), round(s.get("load", 0.0), 1))  # the minute's highest
        # The busiest sample of the minute for other work and the learner's longest GC pause.
        if s.get("others", 0.0) >= row.get("others", 0.0):
            row["others"] = s.get("others", 0.0)
            row["top_others"] = s.get("top_others", [])  # named when they used over 0.3 of a core
        row["gc_max_ms"] = max(row.get("gc_max_ms", 0.0), s.get("gc_max_ms", 0.0))
        row.setdefault("learner_cpu", []).append(s.get("learner_cpu", 0.0))
        row["lat"].append(s["lat_ms"])
    out = []
    for m in sorted(rows):
        row = rows[m]
        lat = np.concatenate(row.pop("lat"))
        row["steps"] = len(lat)
        row["learner_cpu"] = round(float(np.mean(row["learner_cpu"])), 2)  # cores, the minute's mean
        row["p50_ms"] = round(float(np.percentile(lat, 50)), 2) if len(lat) else None
        row["p99_ms"] = round(float(np.percentile(lat, 99)), 2) if len(lat) else None
        row["events"] = sum(1 for t, _ in events if m * 60 <= t < (m + 1) * 60)
        out.append(row)
    return out


def resource_slopes(minutes: list[dict]) -> dict:
    """RSS and fds growth per 10 minutes after the first 5, in % of the value at minute 5 (None
    for runs shorter than 7 minutes), and the largest minute p99 over the first minute's."""
    later = [r for r in minutes if r["minute"] > 5]
    out: dict = {"rss_pct_per_10min": None, "fds_pct_per_10min": None}
    if len(later) >= 2:
        x = np.array([r["minute"] for r in later], float)
        for key in ("rss_mib", "fds"):
            y = np.array([r[key] for r in later], float)
            slope = np.polyfit(x, y, 1)[0] * 10
            out[f"{key.split('_')[0]}_pct_per_10min"] = round(100 * slope / y[0], 2)
    p99 = [r["p99_ms"] for r in minutes if r["p99_ms"] is not None]
    out["p99_max_over_first"] = round(max(p99) / p99[0], 2) if len(p99) >= 2 and p99[0] else None
    # Steps put while the learner was down wait for its successor: the minute it restarted in
    # and the next one measure the outage, not the stream. The rest show drift, if any.
    outage = {r["minute"] + k for a, r in itertools.pairwise(minutes) if r["learner"] != a["learner"] for k in (0, 1)}
    steady = [r["p99_ms"] for r in minutes if r["p99_ms"] is not None and r["minute"] not in outage]
    out["p99_max_over_first_outside_restarts"] = (
        round(max(steady) / steady[0], 2) if len(steady) >= 2 and steady[0] else None
    )
    return out


def print_report(out: dict) -> None:
    print("\n minute  rss_MiB  fds  threads  steps  p50_ms  p99_ms  events  learner  load  others  l_cpu  gc_max")
    for r in out["minutes"]:
        print(f"{r['minute']:>7}  {r['rss_mib']:>7}  {r['fds']:>3}  {r['threads']:>7}  {r['steps']:>5}  "
              f"{r['p50_ms']!s:>6}  {r['p99_ms']!s:>6}  {r['events']:>6}  {r['learner']:>7}  {r['load']:>4}  "
              f"{r['others']:>6}  {r['learner_cpu']:>5}  {r['gc_max_ms']:>6}")  # fmt: skip
    for r in out["minutes"]:
        if r.get("top_others"):
            print(f"[soak] minute {r['minute']}: other work {r['others']} cores, busiest {r['top_others']}")
    for c in out.get("captures", []):
        print(f"[soak] {c['t']:7.1f}s {c['reason']}", flush=True)
    t = out["totals"]
    print(f"\n[soak] {out['streams']} streams: put {t['put']:,} = delivered {t['delivered']:,} + reported lost "
          f"{t['reported_lost']:,} + lost in kills {t['lost_in_kill']:,} + lost at the learner restart "
          f"{t['lost_at_learner_restart']:,}; deduplicated: {t['repeats']:,} resent to a restarted learner, "
          f"{t['learner_duplicates']:,} dropped by the learner; unbalanced streams: {len(out['unbalanced'])}; "
          f"actor errors: {out['actor_errors'] or 'none'}")  # fmt: skip
    print(f"[soak] slopes after minute 5: {out['slopes']}; {'OK' if out['ok'] else 'FAILED'}", flush=True)


def plot(out: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[soak] matplotlib is not installed: no plot (pip install matplotlib)", flush=True)
        return
    rows = out["minutes"]
    x = [r["minute"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(x, [r["rss_mib"] for r in rows], marker="o")
    axes[0].set_ylabel("learner RSS (MiB)")
    axes[1].plot(x, [r["fds"] for r in rows], marker="o", label="open files")
    axes[1].plot(x, [r["threads"] for r in rows], marker="s", label="threads")
    axes[1].legend()
    axes[2].plot(x, [r["p99_ms"] for r in rows], marker="o", label="p99")
    axes[2].plot(x, [r["p50_ms"] for r in rows], marker="s", label="p50")
    axes[2].set_yscale("log")
    load = axes[2].twinx()  # the machine's load: other work on it shows in the p99
    load.plot(x, [r.get("load", 0.0) for r in rows], color="grey", linestyle=":", label="load average")
    load.plot(x, [r.get("others", 0.0) for r in rows], color="red", linestyle="--", label="other work (cores)")
    load.set_ylabel("load average (1 min), dotted; other work's cores, dashed")
    axes[2].set_ylabel("put -> fetch (ms)")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("minute")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"soak: {out['args']['actors']} actors, {out['args']['transport']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"[soak] plot written to {path}", flush=True)

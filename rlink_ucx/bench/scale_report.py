"""The scale benchmark's report: the table of rows and the plot of latency and learner CPU against N."""

from __future__ import annotations

from typing import Any

COLUMNS = [  # (header, key, format)
    ("plane", "transport", "{}"), ("start", "start", "{}"), ("N", "actors", "{}"), ("P", "procs", "{}"), ("B", "batch", "{}"),
    ("conn", "connected", "{}"), ("fail", "connect_failed", "{}"), ("conn_s", "connect_s", "{:.2f}"),
    ("expected", "expected", "{}"), ("delivered", "delivered", "{}"), ("dup", "duplicated", "{}"),
    ("lost", "lost", "{}"), ("p50_ms", "p50_ms", "{:.2f}"), ("p99_ms", "p99_ms", "{:.2f}"),
    ("p99.9_ms", "p999_ms", "{:.2f}"), ("1st_p50", "first_p50_ms", "{:.1f}"), ("1st_p99", "first_p99_ms", "{:.1f}"),
    ("1st>200ms", "first_over_200ms", "{}"),
    ("1st_at_p99_s", "first_fetched_p99_s", "{:.2f}"), ("st_p50", "steady_p50_ms", "{:.2f}"), ("st_p99", "steady_p99_ms", "{:.2f}"),
    ("lrn_cpu", "learner_cpu", "{:.3f}"),
    ("act_cpu/a", "actor_cpu_per_actor", "{:.4f}"), ("rss_MiB/a", "learner_rss_mib_per_actor", "{:.2f}"),
    ("fds", "learner_fds", "{}"), ("died", "died", "{}"),
]  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    cells = [[h for h, _, _ in COLUMNS]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) is not None else "-" for _, k, fmt in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)), flush=True)
    for r in rows:
        label = f"{r['transport']} x{r['actors']}"
        if r.get("error"):
            print(f"  {label}: row failed: {r['error']}")
        for kind, n in r.get("error_kinds", {}).items():
            print(f"  {label}: {n} actor(s): {kind}")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, cpu) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, transport in enumerate(dict.fromkeys(r["transport"] for r in rows)):
        color = f"C{i}"
        mine = sorted((r for r in rows if r["transport"] == transport and r.get("p50_ms") is not None),
                      key=lambda r: r["actors"])  # fmt: skip
        n = [r["actors"] for r in mine]
        lat.plot(n, [r["p50_ms"] for r in mine], "o-", color=color, label=f"{transport} p50")
        lat.plot(n, [r["p99_ms"] for r in mine], "s--", color=color, label=f"{transport} p99")
        with_cpu = [r for r in mine if r.get("learner_cpu") is not None]
        cpu.plot([r["actors"] for r in with_cpu], [r["learner_cpu"] for r in with_cpu], "o-", color=color,
                 label=transport)  # fmt: skip
    for ax in (lat, cpu):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("actors")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_yscale("log")
    lat.set_ylabel("put -> fetch latency (ms)")
    lat.set_title("latency vs actors")
    cpu.set_ylabel("learner CPU (cores)")
    cpu.set_title("learner CPU vs actors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

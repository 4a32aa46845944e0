"""What the demo leaves behind: summary.json and learning_curve.png."""

from __future__ import annotations

import json
import os
from typing import Any


def write_summary(out: str, summary: dict[str, Any]) -> str:
    path = os.path.join(out, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    return path


def plot_curve(out: str, curve: list[tuple[int, float, float]], target: float) -> str:
    """Mean return over the last 100 episodes vs env steps and vs wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(out, "learning_curve.png")
    fig, (by_steps, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [c[0] for c in curve]
    seconds = [c[1] for c in curve]
    returns = [c[2] for c in curve]
    for ax, x, label in ((by_steps, steps, "env steps"), (by_time, seconds, "wall time (s)")):
        ax.plot(x, returns, color="tab:blue")
        ax.axhline(target, color="tab:green", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(label)
        ax.set_ylabel("mean return (last 100 episodes)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("rlink demo: learning curve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

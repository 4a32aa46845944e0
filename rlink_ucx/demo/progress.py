"""Live progress: a rich panel on a terminal, one plain line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any

_ROWS = [
    ("env steps", "{steps:,}"),
    ("steps/s", "{steps_per_s:,.0f}"),
    ("data plane", "{transport} ({mb_per_s:.1f} MB/s)"),
    ("mean return (last 100)", "{mean_return:.1f} / target {target:g} ({episodes:,} episodes)"),
    ("policy lag", "mean {lag_mean:.2f}, max {lag_max} versions"),
    ("model version", "{version}"),
    ("actors", "{actors} connected, {lost} lost"),
    ("elapsed", "{elapsed:.0f} s of {max_seconds:.0f} s"),
]


def say(text: str) -> None:
    """One line about what the demo is doing, at once (a start-up phase has no numbers yet)."""
    print(f"[rlink demo] {text}", flush=True)


class Progress:
    """A progress line at least every ``every`` seconds (plain), or a live panel (terminal).

    The first :meth:`update` prints at once; the caller bounds each wait by :meth:`due`, so a
    run whose batches are slow to come still shows a line on time."""

    def __init__(self, plain: bool | None = None, every: float = 5.0):
        self._live: Any = None
        self._every = every
        self._last = float("-inf")  # the first update prints at once
        if not plain and sys.stdout.isatty():
            try:
                from rich.live import Live

                self._live = Live(refresh_per_second=4, transient=False)
                self._live.start()
            except ImportError:
                self._live = None

    def due(self, most: float) -> float:
        """How long the caller may wait (at most ``most`` seconds) before the next line is due."""
        return max(0.05, min(most, self._last + self._every - time.monotonic()))

    def update(self, values: dict[str, Any]) -> None:
        if self._live is not None:
            from rich.table import Table

            table = Table(title="rlink demo", show_header=False, min_width=60)
            for name, fmt in _ROWS:
                table.add_row(name, fmt.format(**values))
            self._live.update(table)
            return
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            print(
                "[rlink demo] {elapsed:5.0f}s  steps {steps:>9,}  {steps_per_s:>7,.0f}/s  return {mean_return:6.1f}  "
                "lag {lag_mean:.2f}  v{version}  {transport} {mb_per_s:.1f} MB/s  actors {actors} (lost {lost})".format(
                    **values
                ),
                flush=True,
            )

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()

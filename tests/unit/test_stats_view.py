"""`rlink stats`'s arithmetic and layout (rlink_ucx/doctor/stats.py) on learner stats shaped as
`Learner.stats()` returns them: rates from two readings, weights lag, a job's ranks asked at the
addresses rank 0 lists, an unreachable rank shown as such. The network side is tested with real
learners in tests/integration/test_stats_cli.py."""

from __future__ import annotations

import io
import json

from rlink_ucx.doctor import stats as remote_stats
from rlink_ucx.errors import ConnectError


def reading(rank: int, address: str, steps: int, nbytes: int, version: int = 3, acked: tuple[int, ...] = (3, 1),
            ranks: dict | None = None) -> dict:  # fmt: skip
    out = {"rank": rank, "world_size": 2 if ranks is not None or rank else 1, "address": address, "version": version,
           "connected_actors": len(acked), "total": {"steps": steps, "bytes": nbytes},
           "actors": [{"subscribed": True, "weights_version": v} for v in acked] + [{"subscribed": False, "weights_version": 0}],
           "staleness": {"mean": 0.5, "max": 2}, "buffer": {"buffered_bytes": 2_000_000}}  # fmt: skip
    if ranks is not None:
        out["ranks"] = ranks
    return out


def test_rates_come_from_two_readings_and_the_lag_from_the_furthest_behind_subscribed_actor():
    before = [reading(0, "h:1", 1000, 10_000_000)]
    after = [reading(0, "h:1", 3000, 30_000_000, version=5, acked=(5, 2))]
    [row] = remote_stats.view(before, after, 2.0)
    assert (row.rank, row.address, row.actors, row.steps) == (0, "h:1", 2, 3000)
    assert row.steps_per_s == 1000.0 and row.mb_per_s == 10.0
    assert (row.weights_version, row.weights_lag_max, row.staleness_mean, row.staleness_max) == (5, 3, 0.5, 2)
    assert row.buffered_bytes == 2_000_000 and row.error == ""


def test_a_job_is_asked_rank_by_rank_at_the_addresses_rank_0_lists_and_a_missing_rank_is_a_row():
    table = {1: {"address": "h:2", "actors": 1}, 2: {"address": "h:3", "actors": 0}}
    answers = {"h:1": reading(0, "h:1", 10, 100, ranks=table), "h:2": reading(1, "h:2", 20, 200)}
    asked: list[str] = []

    def ask(address: str) -> dict:
        asked.append(address)
        if address not in answers:
            raise ConnectError(f"no answer from {address}")
        return answers[address]

    rows = remote_stats.job("h:1", ask)
    assert asked == ["h:1", "h:2", "h:3"]
    assert [r.get("rank") for r in rows] == [0, 1, 2] and rows[2] == {"rank": 2, "address": "h:3",
                                                                     "error": "no answer from h:3"}  # fmt: skip
    views = remote_stats.view(rows, rows, 1.0)
    assert [v.error for v in views] == ["", "", "no answer from h:3"] and views[1].steps_per_s == 0.0

    out = io.StringIO()
    remote_stats.render(views, 1.0, out)
    text = out.getvalue()
    assert text.startswith("learner job of 3 ranks; rates over 1.0s\n")
    assert "   2  h:3                     unreachable: no answer from h:3" in text
    assert text.rstrip().endswith("total: 4 actors, 0 steps/s")

    out = io.StringIO()
    remote_stats.render(views, 1.0, out, as_json=True, raw=rows)
    got = json.loads(out.getvalue())
    assert [r["rank"] for r in got["ranks"]] == [0, 1, 2] and got["stats"][1]["address"] == "h:2"

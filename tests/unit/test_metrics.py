"""The learner's metrics without a network: histogram buckets, the per-actor label bound, the
families the endpoint serves, and the optional dependency."""

from __future__ import annotations

import bisect
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from rlink_ucx import ConfigError, Learner
from rlink_ucx.observe.counters import LATENCY_BOUNDS, ActorTotals, Buckets, FetchTimings, cumulative

prometheus_client = pytest.importorskip("prometheus_client")


def stats(frames=0, steps=0, bytes=0, **more):
    return SimpleNamespace(frames=frames, steps=steps, bytes=bytes, duplicate_steps=0, lost_steps=0,
                           protocol_errors=0, credit_exhausted=0, **more)  # fmt: skip


def test_buckets_count_values_on_a_bound_in_that_bound_like_prometheus():
    b = Buckets((1.0, 2.0, 5.0))
    values = np.array([0.5, 1.0, 1.5, 2.0, 5.0, 7.0])
    b.observe_many(values, np.array([1, 2, 3, 4, 5, 6], dtype=np.float64))
    b.observe(1.0)
    cum, total = b.read()
    # le=1: 0.5 x1, 1.0 x2, plus the single 1.0; le=2: + 1.5 x3 + 2.0 x4; le=5: + 5.0 x5; +Inf: + 7.0 x6
    assert cum == [4, 11, 16, 22]
    assert total == pytest.approx(0.5 + 2.0 + 4.5 + 8.0 + 25.0 + 42.0 + 1.0)


def test_buckets_match_a_per_value_reference():
    rng = np.random.default_rng(1)
    values = rng.exponential(0.05, 1000)
    weights = rng.integers(1, 50, 1000).astype(np.float64)
    b = Buckets(LATENCY_BOUNDS)
    b.observe_many(values, weights)
    per = [0] * (len(LATENCY_BOUNDS) + 1)
    for v, w in zip(values, weights):
        per[bisect.bisect_left(LATENCY_BOUNDS, v)] += int(w)
    cum, total = b.read()
    assert cum == np.cumsum(per).tolist() and cum[-1] == int(weights.sum())
    assert total == pytest.approx(float((values * weights).sum()))


def test_fetch_timings_count_every_step_of_a_batch():
    t = FetchTimings()
    pieces = [SimpleNamespace(count=30, ready_at=10.0, put_at=99.0), SimpleNamespace(count=70, ready_at=10.5, put_at=0.0),
              SimpleNamespace(count=5, ready_at=10.9, put_at=100.5)]  # fmt: skip
    t.record_fetch(pieces, started=10.9, now=11.0, wall_now=100.0)
    cum, total = t.latency.read()
    assert cum[-1] == 105 and total == pytest.approx(30 * 1.0 + 70 * 0.5 + 5 * 0.1)
    assert cum[LATENCY_BOUNDS.index(0.5)] == 75  # the 70 steps waited exactly 0.5 s
    put_cum, put_total = t.put_latency.read()
    # No put time (0) is left out; a put time ahead of the learner's clock counts as 0.
    assert put_cum[-1] == 35 and put_total == pytest.approx(30 * 1.0)
    assert put_cum[0] == 5 and put_cum[LATENCY_BOUNDS.index(1.0)] == 35
    assert t.fetch.read()[0][-1] == 1 and t.fetch.read()[1] == pytest.approx(0.1)


def test_fetch_timings_of_many_pieces_match_those_of_a_few():
    rng = np.random.default_rng(2)
    pieces = [SimpleNamespace(count=int(c), ready_at=float(r), put_at=float(p))
              for c, r, p in zip(rng.integers(1, 9, 200), 5.0 - rng.exponential(0.02, 200),
                                 rng.choice([0.0, 49.9, 50.2], 200))]  # fmt: skip
    many, few = FetchTimings(), FetchTimings()
    many.record_fetch(pieces, 4.0, 5.0, 50.0)  # one numpy pass
    for i in range(0, 200, 10):
        few.record_fetch(pieces[i : i + 10], 4.0, 5.0, 50.0)  # a loop per piece
    assert many.latency.read()[0] == few.latency.read()[0]
    assert many.latency.read()[0][-1] == sum(p.count for p in pieces)
    assert many.latency.read()[1] == pytest.approx(few.latency.read()[1])
    assert many.put_latency.read()[0] == few.put_latency.read()[0]
    assert many.put_latency.read()[0][-1] == sum(p.count for p in pieces if p.put_at > 0)
    assert many.put_latency.read()[1] == pytest.approx(few.put_latency.read()[1])


def test_staleness_counts_become_cumulative_buckets():
    cum, total = cumulative((0, 1, 2, 4), {0: 5, 1: 2, 3: 1, 9: 4})
    assert cum == [5, 7, 7, 8, 12] and total == 0 * 5 + 1 * 2 + 3 + 36


def test_per_actor_labels_are_bounded_and_the_rest_summed_as_other():
    totals = ActorTotals(max_series=8)
    open_sessions = [(actor, stats(frames=1, steps=actor, bytes=8 * actor)) for actor in range(1, 101)]
    per, total = totals.read(open_sessions)
    assert set(per) == {str(a) for a in range(1, 9)} | {"other"}
    assert per["5"] == {"frames": 1, "steps": 5, "bytes": 40}
    assert per["other"]["steps"] == sum(range(9, 101))
    assert total["steps"] == sum(range(1, 101)) == sum(row["steps"] for row in per.values())
    # Sessions end (and reconnect with fresh counters): nothing goes down, labels stay put.
    for actor, s in open_sessions[:50]:
        totals.ended(actor, s, lost=actor % 2 == 0)
    again = [(actor, stats(frames=1, steps=1, bytes=8)) for actor in range(1, 51)] + open_sessions[50:]
    per2, total2 = totals.read(again)
    assert set(per2) == set(per)
    assert all(per2[k]["steps"] >= per[k]["steps"] for k in per)
    assert per2["5"]["steps"] == 6 and total2["steps"] == total["steps"] + 50
    assert totals.lost_sessions == 25


def fake_sample(actors: int) -> dict:
    totals = ActorTotals(max_series=4)
    per, total = totals.read((a, stats(frames=1, steps=10, bytes=80)) for a in range(actors))
    timings = FetchTimings()
    timings.record_fetch([SimpleNamespace(count=10 * actors, ready_at=1.0, put_at=99.98)], 1.0, 1.002, 100.0)
    return {
        "connected_actors": actors, "handshakes_in_flight": 0, "shed_handshakes": 3, "shed_handshakes_per_peer": 2,
        "preauth_timeouts": 1, "auth_failures": 2,
        "rejected_connections": 0, "reconnects": 1, "lost_sessions": 0, "per_actor": per, "total": total,
        "torn_frames": 0, "stale_dropped": 0, "buffer_used_bytes": 0, "buffer_capacity_bytes": 1 << 20,
        "ready_steps": 0, "version": 7,
        "weights": {"published": 7, "fanouts": 7, "fanout_failures": 0, "streamed": 1, "streamed_bytes": 10, "from_peers": 4, "relayed": 6,
                    "last_fanout_seconds": 0.01},
        "staleness": cumulative((0, 1, 2, 3, 4, 8, 16, 32, 64, 128), {0: 10 * actors}),
        "latency": timings.latency.read(), "put_latency": timings.put_latency.read(), "fetch": timings.fetch.read(), "publish": timings.publish.read(),
    }  # fmt: skip


def test_families_expose_bounded_actor_series_and_the_values_given():
    from prometheus_client.parser import text_string_to_metric_families

    from rlink_ucx.observe.metrics import families

    class Fixed(prometheus_client.registry.Collector):
        def collect(self):
            return families({**fake_sample(actors=20), "rank": 2})

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    text = prometheus_client.generate_latest(registry).decode()
    parsed = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert parsed and {s.labels["rank"] for s in parsed} == {"2"}  # every series names the learner's rank
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank"))): s.value for s in parsed}
    actors = sorted(dict(k[1])["actor"] for k in samples if k[0] == "rlink_actor_steps_received_total")
    assert actors == ["0", "1", "2", "3", "other"]
    assert samples[("rlink_actor_steps_received_total", (("actor", "other"),))] == 160
    assert samples[("rlink_steps_received_total", ())] == 200
    assert samples[("rlink_connected_actors", ())] == 20
    assert samples[("rlink_auth_failures_total", ())] == 2
    assert samples[("rlink_shed_handshakes_total", ())] == 3
    assert samples[("rlink_shed_handshakes_per_peer_total", ())] == 2
    assert samples[("rlink_preauth_timeouts_total", ())] == 1
    assert samples[("rlink_policy_version", ())] == 7
    assert samples[("rlink_weights_from_peers_total", ())] == 4
    assert samples[("rlink_weights_relayed_total", ())] == 6
    assert samples[("rlink_receive_to_fetch_seconds_count", ())] == 200
    assert samples[("rlink_receive_to_fetch_seconds_bucket", (("le", "0.001"),))] == 0
    assert samples[("rlink_receive_to_fetch_seconds_bucket", (("le", "0.0025"),))] == 200
    assert samples[("rlink_put_to_fetch_seconds_count", ())] == 200
    assert samples[("rlink_put_to_fetch_seconds_bucket", (("le", "0.01"),))] == 0  # 20 ms from put
    assert samples[("rlink_put_to_fetch_seconds_bucket", (("le", "0.025"),))] == 200
    assert samples[("rlink_fetched_staleness_bucket", (("le", "0.0"),))] == 200
    assert samples[("rlink_publish_seconds_count", ())] == 0
    assert all(name.startswith("rlink_") for name, _ in samples)


def test_importing_the_package_does_not_import_prometheus_client():
    code = "import sys, rlink_ucx; from rlink_ucx import Learner; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_metrics_without_prometheus_client_say_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # find_spec then finds nothing
    with pytest.raises(ConfigError, match=r'pip install "rlink-ucx\[metrics\]"'):
        Learner("127.0.0.1:0", token="x" * 32, metrics_port=0)


@pytest.mark.parametrize("port", [-1, 65536, "9090", 1.5])
def test_metrics_port_must_be_a_port_number(port):
    with pytest.raises(ConfigError, match="metrics_port"):
        Learner("127.0.0.1:0", token="x" * 32, metrics_port=port)


def test_the_staleness_histogram_stays_bounded_and_its_mean_and_max_stay_exact():
    from rlink_ucx.observe.report import StalenessHistogram

    hist = StalenessHistogram()
    hist.record({5: 1, 5000: 2, -3000: 1})
    for version in range(10_000):  # an actor that gives every frame a version of its own
        hist.record({version: 1})
    summary = hist.summary(dropped=0)
    assert set(summary["histogram"]) == {-StalenessHistogram.CAP, *range(StalenessHistogram.CAP + 1)}
    assert summary["histogram"][-StalenessHistogram.CAP] == 1
    assert summary["histogram"][StalenessHistogram.CAP] == 2 + (10_000 - StalenessHistogram.CAP)
    assert summary["histogram"][5] == 2
    assert summary["max"] == 9999
    assert summary["mean"] == pytest.approx((5 + 10_000 - 3000 + sum(range(10_000))) / 10_004)

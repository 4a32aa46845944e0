"""The benchmark suite end to end, in a tiny configuration (a few seconds of streaming)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rlink_ucx.bench import report, suite, systems

KEYS = {"system", "transport", "workload", "size_bytes", "actors", "gbps", "per_s", "p50_us", "p99_us", "reps"}


@pytest.mark.timeout(120)
def test_tiny_suite_writes_records_and_skips_missing_peers(tmp_path, monkeypatch, capsys):
    # A peer whose package cannot be imported must become a "skipped" row, never vanish.
    ghost = systems.System("ghost", "ghost-peer", "tcp", "peers", ("rlink_no_such_module_xyz",),
                           lambda w, t, a: pytest.fail("a missing peer must not run"))  # fmt: skip
    monkeypatch.setitem(systems.SYSTEMS, "ghost", ghost)
    out = tmp_path / "suite.json"
    png = tmp_path / "suite.png"
    plot = importlib.util.find_spec("matplotlib") is not None
    rc = suite.main(["--quick", "--systems", "memcpy,raw-socket,rlink-tcp,ghost", "--workloads", "64KiB",
                     "--actors", "1", "--warmup", "0.05", "--window", "0.15", "--reps", "2", "--timeout", "30",
                     "--json", str(out)] + (["--plot", str(png)] if plot else []))  # fmt: skip
    assert rc == 0
    records = json.loads(out.read_text())
    by_system = {r["system"]: r for r in records}
    assert set(by_system) == {"memcpy", "raw-socket", "rlink", "ghost-peer"}
    for r in records:
        assert KEYS <= set(r), r
        assert r["workload"] == "64KiB" and r["size_bytes"] == 64 << 10 and r["actors"] == 1
    skipped = by_system["ghost-peer"]
    assert "rlink_no_such_module_xyz" in skipped["skipped"]
    assert skipped["gbps"] is None
    for name in ("memcpy", "raw-socket", "rlink"):
        r = by_system[name]
        assert "error" not in r and "skipped" not in r, r
        assert r["gbps"] > 0 and r["per_s"] > 0
        assert r["gbps_min"] <= r["gbps"] <= r["gbps_max"]
        assert 0 <= r["p50_us"] <= r["p99_us"]
        assert r["reps"] == 2
    assert by_system["rlink"]["transport"] == "tcp"
    assert by_system["rlink"]["cpu_s_per_gb_send"] > 0 and by_system["rlink"]["cpu_s_per_gb_recv"] > 0
    assert not plot or png.stat().st_size > 0
    text = capsys.readouterr().out
    assert "targets" in text and "rlink best plane >= 0.85x raw socket, 64KiB" in text
    assert "skipped: rlink_no_such_module_xyz not installed" in text


def test_targets_ratios_from_records():
    def row(system, workload, per_s, transport="tcp", actors=1, size=1024):
        return {"system": system, "transport": transport, "workload": workload, "actors": actors, "size_bytes": size,
                "per_s": per_s, "gbps": per_s * size / 1e9}  # fmt: skip

    records = [row("raw-socket", "1KiB", 100.0), row("rlink", "1KiB", 40.0), row("rlink", "1KiB", 60.0, "ucx"),
               row("rlink", "atari", 1000.0), row("ray", "atari", 50.0), row("pyzmq-copy", "atari", 800.0),
               row("rlink", "atari", 900.0, actors=4)]  # fmt: skip
    got = {t["target"]: t for t in report.targets(records)}
    assert got["rlink best plane >= 0.5x raw socket, 1KiB"]["ratio"] == pytest.approx(0.6)  # the best plane
    assert got["rlink best plane >= 0.5x raw socket, 1KiB"]["met"] is True
    assert got["rlink >= 10x Ray, atari steps"]["ratio"] == pytest.approx(20.0)
    assert got["rlink >= 1.5x pyzmq-copy, atari steps"]["met"] is False
    assert got["rlink-tcp 4 actors >= 0.8x 1 actor, atari"]["ratio"] == pytest.approx(0.9)
    assert got["rlink best plane >= 0.85x raw socket, 16MiB"]["met"] is None  # not measured


@pytest.mark.timeout(120)
def test_the_raw_socket_limit_takes_several_senders():
    """With 3 senders the raw socket's receiver reads every sender to its end marker (the
    session ends only once all three arrived) and measures their combined stream."""
    from rlink_ucx.bench.limits import RawSocketReceiver, run_raw_socket
    from rlink_ucx.bench.measure import Timing
    from rlink_ucx.bench.workloads import WORKLOADS

    timing = Timing(warmup=0.05, window=0.15, reps=2, timeout=20)
    seen: list[int] = []
    original = RawSocketReceiver.accept

    def accept(self, actors, timeout):
        original(self, actors, timeout)
        seen.append(len(self.conns))

    RawSocketReceiver.accept = accept  # type: ignore[method-assign]
    try:
        out = run_raw_socket(WORKLOADS["64KiB"], timing, 3)
    finally:
        RawSocketReceiver.accept = original  # type: ignore[method-assign]
    assert seen == [3]
    assert out["per_s"] > 0 and out["gbps"] > 0 and out["reps"] >= 1

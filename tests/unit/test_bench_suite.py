"""The benchmark suite end to end, in a tiny configuration (a few seconds of streaming)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from rlink_ucx.bench import peers, report, suite, systems
from rlink_ucx.bench.measure import Timing
from rlink_ucx.bench.workloads import WORKLOADS
from tests.conftest import ucx_importable

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


def test_peer_rows_name_the_checkout_when_their_harness_is_not_installed(tmp_path, monkeypatch):
    """From a wheel (no bench/ beside rlink_ucx) a peer row is skipped with a reason that says
    where its harness is; the harness's rows never run."""
    monkeypatch.setattr(peers, "BENCH_DIR", str(tmp_path))
    for key in ("raw-ucxx", "pyzmq-copy", "torch-gloo", "ray"):
        rec = systems.run_one(key, WORKLOADS["64KiB"], Timing(warmup=0.05, window=0.1, reps=1, timeout=5), 1)
        assert rec["gbps"] is None
        assert rec["skipped"].startswith(f"bench/{systems.SYSTEMS[key].harness}.py is not in the installed wheel")
        assert "source checkout" in rec["skipped"] and ".[bench]" in rec["skipped"]
    with pytest.raises(ImportError, match="source checkout"):
        peers.load("peer_zmq")


def test_the_harness_imports_no_peer_until_a_peer_row_runs():
    code = ("import sys; from rlink_ucx import cli; from rlink_ucx.bench import suite, systems, replay, scale; "
            "from rlink_ucx.bench.peers import BENCH_DIR; "
            "print(sorted(m for m in sys.modules if m.startswith('peer_')), BENCH_DIR in sys.path)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["[]", "False"], done.stdout + done.stderr


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


def test_targets_against_the_raw_socket_with_as_many_senders_and_shm_against_raw():
    def row(system, workload, gbps, transport="tcp", actors=1):
        return {"system": system, "transport": transport, "workload": workload, "actors": actors, "size_bytes": 4096,
                "per_s": gbps * 1e9 / 4096, "gbps": gbps}  # fmt: skip

    records = [row("raw-socket", "atari", 7.0), row("raw-socket", "atari", 10.0, actors=4),
               row("rlink", "atari", 4.5, actors=4), row("rlink", "atari", 8.5, "shm", actors=4),
               row("rlink", "atari", 4.0), row("rlink", "atari", 6.0, "shm"),
               row("raw-socket", "4KiB", 1.0), row("rlink", "4KiB", 1.2, "shm"), row("rlink", "1KiB", 1.0, "shm")]
    got = {t["target"]: t for t in report.targets(records)}
    tcp4, shm4 = (got[f"rlink-{p} x4 >= 0.8x raw-socket x4, atari"] for p in ("tcp", "shm"))
    assert tcp4["ratio"] == pytest.approx(0.45) and tcp4["met"] is False  # against raw x4 (10), not raw x1 (7)
    assert shm4["ratio"] == pytest.approx(0.85) and shm4["met"] is True
    assert "rlink-tcp x4 >= 0.8x raw-socket-ring x4, atari" not in got  # no ring row in this run
    got = {t["target"]: t for t in report.targets([*records, row("raw-socket-ring", "atari", 5.0, actors=4)])}
    ring = got["rlink-tcp x4 >= 0.8x raw-socket-ring x4, atari"]  # the receiver that keeps its data
    assert ring["ratio"] == pytest.approx(0.9) and ring["met"] is True
    assert got["rlink-tcp x4 >= 0.8x raw-socket x4, atari"]["met"] is False  # the hot-buffer line stays
    assert "rlink-tcp x4 >= 0.8x raw-ucxx x4, atari" not in got  # UCX is the substrate of ucx alone
    ucx = [row("rlink", "atari", 4.4, "ucx", actors=4), row("raw-ucxx", "atari", 4.0, "ucx", actors=4),
           row("raw-ucxx", "atari", 12.0, "ucx")]  # fmt: skip
    got = {t["target"]: t for t in report.targets([*records, *ucx])}
    assert got["rlink-ucx x4 >= 0.8x raw-ucxx x4, atari"]["ratio"] == pytest.approx(1.1)  # x4 against x4, not x1
    assert got["rlink-shm >= 1.0x raw socket, atari"]["ratio"] == pytest.approx(6.0 / 7.0)
    assert got["rlink-shm >= 1.0x raw socket, 4KiB"]["met"] is True
    assert "rlink-shm >= 1.0x raw socket, 1KiB" not in got  # below 4 KiB no such target


def test_the_rlink_ring_holds_every_actors_window():
    """One actor keeps the 64 MiB ring; with 4 each can still hold its configured window in the
    half of the ring the learner lends out (else they wait for credit: docs/benchmarks.md)."""
    from rlink_ucx import Config
    from rlink_ucx.bench.rlink import rlink_config

    atari = WORKLOADS["atari"].with_chunk(32)
    window = Config.from_env().actor_window_bytes
    one, batch = rlink_config(atari, 1)
    four, batch4 = rlink_config(atari, 4)
    assert one["buffer_bytes"] == 64 << 20 and batch == batch4 == (4 << 20) // atari.wire_step_bytes
    assert four["buffer_bytes"] == 2 * 4 * window
    big = WORKLOADS["16MiB"]
    assert rlink_config(big, 4)[0]["buffer_bytes"] == 16 * big.wire_step_bytes  # 16 batches of one step: more


@pytest.mark.timeout(120)
def test_the_raw_socket_limit_takes_several_senders():
    """With 3 senders the raw socket's receiver reads every sender to its end marker (the
    session ends only once all three arrived) and measures their combined stream."""
    from rlink_ucx.bench.limits import RawSocketReceiver, run_raw_socket

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


@pytest.mark.timeout(120)
def test_the_raw_socket_ring_lands_each_message_in_the_next_slot():
    """raw-socket-ring: messages land in turn in the slots of a 256 MiB buffer (as rlink's
    frames land in its ring), wrapping, and are still timed from their own stamps."""
    from rlink_ucx.bench.limits import RING_BYTES, RawSocketReceiver, run_raw_socket

    work = WORKLOADS["1MiB"]
    receiver = RawSocketReceiver(work, ring=True)
    assert len(receiver.slots) == RING_BYTES // (work.chunk * work.wire_step_bytes) >= 200
    turns: list[int] = []
    original = RawSocketReceiver.recv

    def recv(self, rec):
        turns.append(self.turn)
        return original(self, rec)

    RawSocketReceiver.recv = recv  # type: ignore[method-assign]
    try:
        out = run_raw_socket(work, Timing(warmup=0.05, window=0.15, reps=2, timeout=20), 2, ring=True)
    finally:
        RawSocketReceiver.recv = original  # type: ignore[method-assign]
    receiver.close()
    assert turns[:3] == [0, 1, 2] and len(set(turns)) > 3
    assert out["per_s"] > 0 and out["gbps"] > 0


@pytest.mark.timeout(120)
@pytest.mark.skipif(not ucx_importable(), reason="ucxx not installed")
def test_raw_ucxx_takes_several_senders_each_on_tags_of_its_own():
    """raw-ucxx with 3 senders: every sender is read, in its own order, to its end marker,
    and none is starved while the others stream."""

    peer_ucxx = peers.load("peer_ucxx")
    UcxxReceiver, run_raw_ucxx = peer_ucxx.UcxxReceiver, peer_ucxx.run_raw_ucxx

    served: list[int] = []
    stamps: dict[int, list[int]] = {0: [], 1: [], 2: []}
    original = UcxxReceiver._take

    def take(self, sender, rec):
        served.append(sender)
        stamp = int(self.slots[sender][self.cur[sender]][0][0])
        if stamp >= 0:  # (the end markers are -1)
            stamps[sender].append(stamp)
        return original(self, sender, rec)

    UcxxReceiver._take = take  # type: ignore[method-assign]
    try:
        out = run_raw_ucxx(WORKLOADS["64KiB"].with_chunk(4), Timing(warmup=0.05, window=0.15, reps=2, timeout=30), 3)
    finally:
        UcxxReceiver._take = original  # type: ignore[method-assign]
    assert sorted(set(served)) == [0, 1, 2]
    assert min(served.count(s) for s in range(3)) >= 10  # every sender streamed, none starved
    assert all(v == sorted(v) and len(set(v)) == len(v) for v in stamps.values())  # each sender's chunks in its order
    assert out["per_s"] > 0 and out["gbps"] > 0 and out["reps"] >= 1


def test_raw_ucxx_serves_senders_whose_chunks_are_in_in_turn():
    """With every sender's next chunk in, the receiver takes them in turn, not the first one
    again and again (a sender streaming fast must not starve the others)."""
    UcxxReceiver = peers.load("peer_ucxx").UcxxReceiver

    class Done:
        completed = True

    receiver = UcxxReceiver.__new__(UcxxReceiver)
    receiver.live, receiver.turn, receiver.cur, receiver.timeout = [0, 1, 2], 0, [0, 0, 0], 5.0
    receiver.requests = [[[Done()], [Done()]] for _ in range(3)]
    receiver.worker = type("Worker", (), {"progress": lambda self: None})()
    served: list[int] = []
    receiver._take = lambda sender, rec: served.append(sender) or 0  # type: ignore[method-assign]
    for _ in range(7):
        receiver.recv(None)  # type: ignore[arg-type]
    assert served == [0, 1, 2, 0, 1, 2, 0]

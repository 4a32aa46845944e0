"""The soak's records of a slow minute (bench/soak_watch.py): whose CPU the machine spent, the
learner's GC pauses, and stack dumps when the learner stalls or a sample is slow."""

from __future__ import annotations

import gc
import os
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from bench import soak_watch

pytestmark = pytest.mark.timeout(60)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_machine_cpu_splits_the_soaks_processes_from_other_work_and_names_the_busiest():
    cpu = soak_watch.MachineCpu()
    _spin(0.6)
    mine = cpu.read({os.getpid()})
    assert mine["soak"] > 0.5 and mine["machine"] >= mine["soak"] - 0.2  # this process spun a core
    assert mine["others"] == pytest.approx(max(0.0, mine["machine"] - mine["soak"]), abs=0.011)
    _spin(0.6)
    theirs = cpu.read(set())  # the same work, now not the soak's
    assert theirs["soak"] == 0.0 and theirs["others"] > 0.5
    with open(f"/proc/{os.getpid()}/comm") as f:
        name = f.read().strip()
    assert theirs["top_others"][0][0] == name and theirs["top_others"][0][1] > 0.5


def test_gc_pauses_counts_collections_since_the_last_take_then_starts_over():
    pauses = soak_watch.GcPauses()
    try:
        pauses.take()
        gc.collect()
        gc.collect(0)
        got = pauses.take()
        assert got["gc_count"] >= 2 and got["gc_full"] >= 1
        assert got["gc_max_ms"] > 0 and got["gc_ms"] >= got["gc_max_ms"]
        gc.disable()
        try:
            assert pauses.take() == {"gc_count": 0, "gc_full": 0, "gc_ms": 0.0, "gc_max_ms": 0.0}
        finally:
            gc.enable()
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks


def test_stalled_is_late_by_more_than_the_factor_of_intervals():
    assert not soak_watch.stalled(now=112.0, last_sample=100.0, interval=5.0)  # 2.4 intervals
    assert soak_watch.stalled(now=113.0, last_sample=100.0, interval=5.0)  # 2.6


def _fake_py_spy(tmp_path: pathlib.Path) -> str:
    script = tmp_path / "py-spy"
    script.write_text('#!/bin/sh\necho "Thread 7 (active): fetch; args: $*"\n')
    script.chmod(0o755)
    return str(script)


def _wait_for(predicate, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_learner_that_stops_sampling_gets_its_stacks_dumped_once_per_gap(tmp_path):
    watch = soak_watch.StallWatch(lambda: 4321, interval=0.2, min_gap=60.0, py_spy=_fake_py_spy(tmp_path))
    watch.start()
    try:
        assert _wait_for(lambda: watch.captures)
        time.sleep(1.5)  # still stalled, but within the gap between dumps
    finally:
        watch.close()
    assert len(watch.captures) == 1
    capture = watch.captures[0]
    assert capture["reason"].startswith("no sample from the learner for")
    assert "dump --nonblocking --pid 4321" in capture["stack"] and "Thread 7" in capture["stack"]


def test_a_slow_sample_gets_a_dump_and_a_paused_learner_none(tmp_path):
    watch = soak_watch.StallWatch(lambda: 99, interval=0.2, min_gap=0.0, py_spy=_fake_py_spy(tmp_path))
    watch.paused = True  # being restarted: its silence is expected
    watch.start()
    try:
        time.sleep(1.5)
        assert watch.captures == []
        watch.sample(p99_ms=8.0, slow_ms=10.0)  # fast enough: nothing
        time.sleep(1.0)
        assert watch.captures == []
        watch.sample(p99_ms=50.0, slow_ms=10.0)
        assert _wait_for(lambda: watch.captures)
    finally:
        watch.close()
    assert watch.captures[0]["reason"] == "a sample's p99 was 50 ms (over 10 ms)"


def test_without_py_spy_the_watch_says_so_once_and_dumps_nothing():
    watch = soak_watch.StallWatch(lambda: 1, interval=0.1, min_gap=0.0, py_spy="")
    watch.dump("any reason")
    watch.sample(p99_ms=50.0, slow_ms=10.0)
    assert [c["reason"] for c in watch.captures] == ["py-spy is not installed: no stacks"]
    watch.close()  # never started: nothing to join

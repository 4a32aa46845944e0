"""Replay benchmarks: sampling rates, insert rate against RLinkDataset, checkpoint speed vs disk.

    python bench/replay.py [--only uniform,prioritized,insert,checkpoint] [--quick] [--json [PATH]]

- ``uniform``: ``ReplayDataset.sample()`` of B=256 Atari-sized steps (obs uint8 84x84x4 +
  action, reward, done) from a full table of ``--atari-capacity`` steps: batches/s and items/s.
- ``prioritized``: at capacity ``--capacity`` (1M) of small steps, ms per ``sample()`` +
  ``update_priorities()`` of B=256 through the replay, and the sum tree's own share.
- ``insert``: one actor process streams the same workload over the learner's default plane
  into ``RLinkDataset`` (fetch loop) and into ``ReplayDataset`` (inserter thread only), runs
  alternating; steps/s of each and their ratio.
- ``checkpoint``: save and load of a ``--ckpt-gb`` GB table against a plain sequential file
  write (+ fsync) and read of the same size in the same run; the page cache is dropped before
  each read where the kernel allows it (root), and the report says whether it was.

It uses two internals to fill tables without actors: ``StepRing`` (fed as a receiving plane
does) and ``ReplayDataset._core`` (the table's storage, for the checkpoint size).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ATARI = {"obs": ("uint8", (84, 84, 4)), "action": ("int64", ()), "reward": ("float32", ()), "done": ("bool", ())}
SMALL = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ()), "done": ("bool", ())}
B = 256


class _Source:
    """What ReplayDataset uses of a Learner, around a StepRing fed by this process."""

    def __init__(self, ring: Any):
        from rlink_ucx import Config

        self.ring, self.version, self.closed, self.config = ring, 0, False, Config()

    def _wait_ring(self, timeout: float) -> Any:
        return self.ring


def _fill(spec: dict, capacity: int, **kw: Any) -> Any:
    """A ReplayDataset holding ``capacity`` steps of ``spec``, fed through a real StepRing."""
    from rlink_ucx import ReplayDataset
    from rlink_ucx.store.ring import StepRing
    from rlink_ucx.wire.codec import Schema

    schema = Schema.from_spec(spec)
    frame = max(1, (1 << 20) // schema.step_bytes)
    ring = StepRing(schema, 64 << 20, frame)
    replay = ReplayDataset(_Source(ring), capacity=capacity, batch_size=B, **kw)
    payload = [np.random.default_rng(0).integers(0, 255, frame * f.step_bytes, dtype=np.uint8) for f in schema.fields]
    seq = 0
    while seq < capacity:
        n = min(frame, capacity - seq)
        while ring.grantable() < n:
            time.sleep(0.0005)
        ring.grant(n)
        seg = ring.reserve(n, 1, seq, 0)
        for data, views in zip(payload, ring.field_views(seg)):
            at = 0
            for v in views:
                v[:] = data[at : at + len(v)]
                at += len(v)
        ring.commit(seg)
        seq += n
    while replay.inserted < capacity:
        time.sleep(0.001)
    return replay


def bench_uniform(capacity: int, seconds: float) -> dict[str, Any]:
    replay = _fill(ATARI, capacity, sampler="uniform")
    for _ in range(5):
        replay.sample(10)
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        replay.sample(10)
        n += 1
    per_s = n / (time.perf_counter() - started)
    step_bytes = 84 * 84 * 4 + 8 + 4 + 1
    replay.close()
    return {"capacity": capacity, "batch": B, "batches_per_s": round(per_s, 1), "items_per_s": round(per_s * B),
            "gb_per_s": round(per_s * B * step_bytes / 1e9, 2)}  # fmt: skip


def bench_prioritized(capacity: int, reps: int) -> dict[str, Any]:
    replay = _fill(SMALL, capacity, sampler="prioritized", seed=0)
    rng = np.random.default_rng(1)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        b = replay.sample(10)
        replay.update_priorities(b.index, rng.random(B) + 0.01)
        times.append(time.perf_counter() - t)
    tree = replay._core.sampler.tree
    tree_times = []
    for _ in range(reps):
        t = time.perf_counter()
        slots = tree.sample(rng, B)
        tree.set(slots, rng.random(B))
        tree_times.append(time.perf_counter() - t)
    replay.close()
    return {"capacity": capacity, "batch": B, "ms_per_sample_update": round(statistics.median(times) * 1e3, 3),
            "p90_ms": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3),
            "sum_tree_ms": round(statistics.median(tree_times) * 1e3, 3)}  # fmt: skip


# --- insert rate: replay vs RLinkDataset on the same actor stream ------------------------------------
def _streamer(address: str, spec: dict, chunk: int, stop: Any) -> None:
    from rlink_ucx import Actor, Closed

    rng = np.random.default_rng(0)
    steps = {k: rng.integers(0, 100, (chunk, *shape)).astype(dt) for k, (dt, shape) in spec.items()}
    try:
        with Actor(address) as actor:
            while not stop.is_set():
                actor.put_many(steps)
    except Closed:
        pass


def _insert_run(kind: str, spec: dict, chunk: int, seconds: float) -> float:
    from rlink_ucx import Learner, ReplayDataset, RLinkDataset, RLinkError

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    with Learner("127.0.0.1:0") as learner:
        if kind == "replay":
            ds = ReplayDataset(learner, capacity=200_000 if spec is SMALL else 20_000, batch_size=B)

            def count() -> int:
                return ds.inserted
        else:
            ds = RLinkDataset(learner, batch_size=B)
            got = [0]

            def consume() -> None:
                try:
                    while True:
                        ds.fetch(timeout=30)
                        got[0] += B
                except RLinkError:  # the learner closed: the run is over
                    return

            threading.Thread(target=consume, daemon=True).start()

            def count() -> int:
                return got[0]

        proc = ctx.Process(target=_streamer, args=(learner.address, spec, chunk, stop))
        proc.start()
        deadline = time.monotonic() + 60
        while count() < 4 * B and time.monotonic() < deadline:  # warm up: connected and streaming
            time.sleep(0.01)
        time.sleep(0.3)
        n0, t0 = count(), time.perf_counter()
        time.sleep(seconds)
        rate = (count() - n0) / (time.perf_counter() - t0)
        stop.set()
        if kind == "replay":
            ds.close()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    return rate


def bench_insert(seconds: float, reps: int) -> list[dict[str, Any]]:
    rows = []
    for name, spec, chunk in (("small", SMALL, 256), ("atari", ATARI, 32)):
        runs: dict[str, list[float]] = {"rlinkdataset": [], "replay": []}
        for _ in range(reps):  # alternate, so drift of a shared machine hits both
            runs["rlinkdataset"].append(_insert_run("dataset", spec, chunk, seconds))
            runs["replay"].append(_insert_run("replay", spec, chunk, seconds))
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows.append({"workload": name, "rlinkdataset_steps_per_s": round(med["rlinkdataset"]),
                     "replay_steps_per_s": round(med["replay"]), "ratio": round(med["replay"] / med["rlinkdataset"], 3),
                     "runs": {k: [round(x) for x in v] for k, v in runs.items()}})  # fmt: skip
    return rows


# --- checkpoint vs disk ----------------------------------------------------------------------------
def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _plain_write(path: Path, nbytes: int, chunk: np.ndarray) -> float:
    """GB/s of a plain sequential write of ``nbytes`` (64 MiB chunks, then fsync)."""
    os.sync()
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.writelines(memoryview(chunk) for _ in range(nbytes // chunk.size))
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - t) / 1e9


def _plain_read(path: Path, nbytes: int) -> float:
    buf = np.empty(64 << 20, dtype=np.uint8)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(memoryview(buf)):
            pass
    return nbytes / (time.perf_counter() - t) / 1e9


def _filled_replay(gb: float) -> Any:
    """A prioritized replay whose table (Atari steps) holds ``gb`` GB, filled directly."""
    from rlink_ucx import ReplayDataset
    from rlink_ucx.store.ring import StepRing
    from rlink_ucx.wire.codec import Schema

    schema = Schema.from_spec(ATARI)
    capacity = int(gb * 1e9) // schema.step_bytes // 1024 * 1024
    replay = ReplayDataset(
        _Source(StepRing(schema, 1 << 20, 8)), capacity=capacity, batch_size=B, sampler="prioritized"
    )
    while replay._core.table is None:
        time.sleep(0.01)
    core = replay._core
    with core.cond:  # the table's bytes are what is measured, not how they arrived
        tile = np.random.default_rng(0).integers(0, 255, 1 << 24, dtype=np.uint8)
        for rows in core.table.rows:
            flat = rows.reshape(-1)
            for lo in range(0, flat.size, tile.size):
                flat[lo : lo + tile.size] = tile[: flat.size - lo]
        core.table.publish(capacity)
        core.sampler.on_insert(np.arange(capacity), None)
        core.limiter.inserted = capacity
    return replay, capacity * schema.step_bytes


def bench_checkpoint(gb: float, where: str, reps: int) -> dict[str, Any]:
    """Plain write vs save, then plain read vs load, ``reps`` times in alternating order (the
    page cache dropped before each read)."""
    from rlink_ucx import ReplayDataset
    from rlink_ucx.store.ring import StepRing
    from rlink_ucx.wire.codec import Schema

    replay, nbytes = _filled_replay(gb)
    chunk = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    root = Path(tempfile.mkdtemp(prefix="rlink-replay-bench-", dir=where))
    runs: dict[str, list[float]] = {"disk_write": [], "save": [], "disk_read": [], "load": []}
    dropped = True
    try:
        for rep in range(reps):
            # The disk here writes in bursts (fast after idle, then its sustained speed): alternate
            # which of the two writes goes first so both see the same conditions.
            for first in (False, True) if rep % 2 else (True, False):
                if first:
                    runs["disk_write"].append(_plain_write(root / "plain", nbytes, chunk))
                else:
                    t = time.perf_counter()
                    replay.save(root / "ckpt")
                    runs["save"].append(nbytes / (time.perf_counter() - t) / 1e9)
            for first in (False, True) if rep % 2 else (True, False):
                dropped &= _drop_caches()
                if first:
                    runs["disk_read"].append(_plain_read(root / "plain", nbytes))
                else:
                    t = time.perf_counter()
                    loaded = ReplayDataset.load(root / "ckpt", _Source(StepRing(Schema.from_spec(ATARI), 1 << 20, 8)))
                    runs["load"].append(nbytes / (time.perf_counter() - t) / 1e9)
                    assert len(loaded) == len(replay)
                    loaded.close()
                    del loaded
            (root / "plain").unlink()
        on_disk = sum(f.stat().st_size for f in (root / "ckpt").iterdir())
    finally:
        replay.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"table_gb": round(nbytes / 1e9, 2), "files_gb": round(on_disk / 1e9, 2), "reps": reps,
            **{f"{k}_gb_s": round(v, 2) for k, v in med.items()},
            "save_vs_disk": round(med["save"] / med["disk_write"], 2), "load_vs_disk": round(med["load"] / med["disk_read"], 2),
            "runs_gb_s": {k: [round(x, 2) for x in v] for k, v in runs.items()}, "page_cache_dropped": dropped,
            "dir": where}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="replay benchmarks")
    parser.add_argument("--only", default="uniform,prioritized,insert,checkpoint")
    parser.add_argument("--quick", action="store_true", help="small sizes, short runs (for tests)")
    parser.add_argument("--atari-capacity", type=int, default=20_000)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--ckpt-gb", type=float, default=4.0)
    parser.add_argument("--ckpt-dir", default=tempfile.gettempdir())
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--reverb", metavar="PYTHON", help="an interpreter with dm-reverb: run bench/reverb_side.py "
                        "with it right after the uniform run and report the ratio")  # fmt: skip
    parser.add_argument(
        "--json", nargs="?", const="-", default=None, help="write the report as JSON (to PATH or stdout)"
    )
    args = parser.parse_args()
    if args.quick:
        args.atari_capacity, args.capacity, args.ckpt_gb, args.seconds, args.reps = 2000, 100_000, 0.2, 1.0, 1
    only = set(args.only.split(","))
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    if "uniform" in only:
        report["uniform"] = bench_uniform(args.atari_capacity, args.seconds)
        log(
            f"uniform B={B} Atari: {report['uniform']['batches_per_s']} batches/s = {report['uniform']['items_per_s']} items/s"
        )
        if args.reverb:
            report["reverb"] = r = _reverb(args.reverb, args.atari_capacity, args.seconds)
            for path in ("tfdata", "client"):
                r[f"rlink_vs_{path}"] = round(report["uniform"]["items_per_s"] / r[f"{path}_items_per_s"], 2)
            log(f"reverb {r['reverb']}: tf.data {r['tfdata_items_per_s']} items/s (rlink {r['rlink_vs_tfdata']}x), "
                f"Client.sample {r['client_items_per_s']} items/s (rlink {r['rlink_vs_client']}x)")  # fmt: skip
    if "prioritized" in only:
        report["prioritized"] = p = bench_prioritized(args.capacity, 300 if args.quick else 2000)
        log(
            f"prioritized B={B} at {p['capacity']}: {p['ms_per_sample_update']} ms sample+update (tree {p['sum_tree_ms']} ms)"
        )
    if "insert" in only:
        report["insert"] = bench_insert(args.seconds, args.reps)
        for row in report["insert"]:
            log(f"insert {row['workload']}: replay {row['replay_steps_per_s']}/s vs RLinkDataset "
                f"{row['rlinkdataset_steps_per_s']}/s = {row['ratio']}x")  # fmt: skip
    if "checkpoint" in only:
        report["checkpoint"] = c = bench_checkpoint(args.ckpt_gb, args.ckpt_dir, args.reps)
        log(f"checkpoint {c['table_gb']} GB: save {c['save_gb_s']} GB/s ({c['save_vs_disk']}x disk write "
            f"{c['disk_write_gb_s']}), load {c['load_gb_s']} GB/s ({c['load_vs_disk']}x disk read {c['disk_read_gb_s']}),"
            f" page cache dropped: {c['page_cache_dropped']}; runs {c['runs_gb_s']}")  # fmt: skip
    if args.json == "-":
        print(json.dumps(report, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _reverb(python: str, capacity: int, seconds: float) -> dict[str, Any]:
    import subprocess

    script = Path(__file__).with_name("reverb_side.py")
    done = subprocess.run([python, str(script), "--capacity", str(capacity), "--seconds", str(seconds)],
                          capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

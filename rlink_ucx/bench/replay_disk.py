"""Replay checkpoint speed against the disk: save / load of a table vs a plain sequential
write (+ fsync) / read of the same size, in the same run (``rlink bench --suite replay``).

The disk of a shared VM often writes in bursts (fast after idle, then its sustained speed), so
the runs alternate which of the two writes (and reads) goes first and report medians. The page
cache is dropped before each read where the kernel allows it (root); the report says whether.
Each rep also writes and reads the same size with ``O_DIRECT`` (no page cache: the device's own
sequential speed, where the file system allows it; None where it does not).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .replay_runs import ATARI, B, source


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
    full, rest = divmod(nbytes, chunk.size)
    with open(path, "wb", buffering=0) as f:
        f.writelines([chunk.data] * full + [chunk.data[:rest]])
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - t) / 1e9


def _plain_read(path: Path, nbytes: int) -> float:
    buf = np.empty(64 << 20, dtype=np.uint8)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf.data):
            pass
    return nbytes / (time.perf_counter() - t) / 1e9


def _direct(path: Path, nbytes: int, write: bool) -> float | None:
    """GB/s of an O_DIRECT sequential write (+ fsync) or read of about ``nbytes`` (whole requests
    of up to 64 MiB), or None where the file system refuses O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return None
    size = min(64 << 20, nbytes // 4096 * 4096)  # whole pages, as O_DIRECT wants
    if not size:
        return None
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
    buf.write(np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8).tobytes())
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError:  # a file system without O_DIRECT (tmpfs)
        return None
    try:
        t = time.perf_counter()
        for _ in range(nbytes // len(buf)):
            if (os.writev(fd, [buf]) if write else os.readv(fd, [buf])) != len(buf):
                return None
        if write:
            os.fsync(fd)
        return nbytes // len(buf) * len(buf) / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def filled_replay(gb: float, storage: str = "host", device: str = "cpu") -> tuple[Any, int]:
    """A prioritized replay whose table (Atari steps) holds ``gb`` GB, filled directly."""
    import torch

    from ..replay import ReplayDataset
    from ..store.ring import StepRing
    from ..wire.codec import Schema

    schema = Schema.from_spec(ATARI)
    capacity = max(B, int(gb * 1e9) // schema.step_bytes // 1024 * 1024)
    replay = ReplayDataset(source(StepRing(schema, 1 << 20, 8)), capacity=capacity, batch_size=B,
                           sampler="prioritized", storage=storage, device=device)  # fmt: skip
    deadline = time.monotonic() + 60
    while replay._core.table is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the replay's table was not allocated within 60 s")
        time.sleep(0.01)
    core = replay._core
    table, sampler = core.table, core.sampler
    if table is None or sampler is None:  # made together with the table, awaited above
        raise RuntimeError("the replay's table or sampler is missing")
    with core.cond:  # the table's bytes are what is measured, not how they arrived
        tile = torch.from_numpy(np.random.default_rng(0).integers(0, 255, 1 << 24, dtype=np.uint8))
        for rows in table.rows:  # numpy arrays (host storage) or tensors (device storage)
            flat = rows.reshape(-1) if isinstance(rows, torch.Tensor) else torch.from_numpy(rows.reshape(-1))
            for lo in range(0, flat.numel(), tile.numel()):
                part = flat[lo : lo + tile.numel()]
                part.copy_(tile[: part.numel()])
        table.publish(capacity)
        sampler.on_insert(np.arange(capacity), None)
        core.limiter.inserted = capacity
    return replay, capacity * schema.step_bytes


def bench_checkpoint(gb: float, where: str, reps: int, storage: str = "host", device: str = "cpu") -> dict[str, Any]:
    """Plain write vs save, then plain read vs load, ``reps`` times in alternating order."""
    from ..replay import ReplayDataset
    from ..store.ring import StepRing
    from ..wire.codec import Schema

    replay, nbytes = filled_replay(gb, storage, device)
    chunk = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    root = Path(tempfile.mkdtemp(prefix="rlink-replay-bench-", dir=where))
    runs: dict[str, list[float]] = {"disk_write": [], "save": [], "disk_read": [], "load": []}
    direct: dict[str, list[float]] = {"write": [], "read": []}
    dropped = True
    try:
        for rep in range(reps):
            order = (False, True) if rep % 2 else (True, False)  # True: the plain file operation
            for plain in order:
                if plain:
                    runs["disk_write"].append(_plain_write(root / "plain", nbytes, chunk))
                else:
                    os.sync()  # as the plain write does: nobody else's dirty pages in this run
                    t = time.perf_counter()
                    replay.save(root / "ckpt")
                    runs["save"].append(nbytes / (time.perf_counter() - t) / 1e9)
            for plain in order:
                dropped &= _drop_caches()
                if plain:
                    runs["disk_read"].append(_plain_read(root / "plain", nbytes))
                else:
                    t = time.perf_counter()
                    loaded = ReplayDataset.load(root / "ckpt", source(StepRing(Schema.from_spec(ATARI), 1 << 20, 8)),
                                                storage=storage, device=device)  # fmt: skip
                    runs["load"].append(nbytes / (time.perf_counter() - t) / 1e9)
                    if len(loaded) != len(replay):
                        raise RuntimeError(f"loaded {len(loaded)} steps, saved {len(replay)}")
                    loaded.close()
                    del loaded
            (root / "plain").unlink()
            for kind in ("write", "read"):
                dropped &= _drop_caches()
                if (got := _direct(root / "direct", nbytes, kind == "write")) is not None:
                    direct[kind].append(got)
            (root / "direct").unlink(missing_ok=True)
        on_disk = sum(f.stat().st_size for f in (root / "ckpt").iterdir())
    finally:
        replay.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"table_gb": round(nbytes / 1e9, 2), "files_gb": round(on_disk / 1e9, 2), "reps": reps, "storage": storage,
            "device": device,
            **{f"{k}_gb_s": round(v, 2) for k, v in med.items()},
            "save_vs_disk": round(med["save"] / med["disk_write"], 2), "load_vs_disk": round(med["load"] / med["disk_read"], 2),
            "runs_gb_s": {k: [round(x, 2) for x in v] for k, v in runs.items()}, "page_cache_dropped": dropped,
            **{f"direct_{k}_gb_s": round(statistics.median(v), 2) if v else None for k, v in direct.items()},
            "direct_runs_gb_s": {k: [round(x, 2) for x in v] for k, v in direct.items()}, "dir": where}  # fmt: skip

"""Replay checkpoints: a directory of raw ``.npy`` arrays and a JSON manifest, never pickle.

``save`` pauses inserts (the actors wait on credit meanwhile; sampling goes on), copies the
small state (counters, metadata, priorities) under the lock, then streams each field's rows
straight from the table to its file in chunks, oldest step first, hashing each chunk with
XXH3-128 (~13 GB/s on one core, so hashing costs a few percent of a disk's time). Files go to a temporary directory that is
renamed to ``path`` at the end, so a crash leaves either the old checkpoint or the new one.
``load`` refuses a manifest of another format, a file whose size, header or checksum differs
(a truncated or corrupted checkpoint) with :class:`CheckpointError`, and a table of another
schema than the learner's with ``SchemaMismatch``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import ConfigError
from ..wire.codec import DTYPES, Schema
from .replay_core import ReplayCore

__all__ = ["CheckpointError", "read_manifest", "restore", "save"]

FORMAT = "rlink-replay"
FORMAT_VERSION = 1
_CHUNK = 64 << 20  # bytes per write / read / hash call
CHECKSUM = "xxh3_128"  # of each whole file, as `xxh128sum` prints it


class CheckpointError(ConfigError):
    """A replay checkpoint is missing, truncated, corrupted or of another format."""


def save(core: ReplayCore, path: str | os.PathLike[str], settings: dict[str, Any]) -> dict[str, Any]:
    """Write a consistent snapshot of ``core`` to the directory ``path``; returns the manifest."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    core.pause()
    try:
        with core.cond:
            table, sampler = core.table, core.sampler
            if table is None or sampler is None:
                raise ConfigError("nothing to save yet: no actor has sent a schema")
            runs, held = table.id_order_runs(), table.held
            slots = np.concatenate([np.arange(s, s + k) for s, k in runs] or [np.zeros(0, np.int64)])
            meta = np.stack([table.actor_id[slots], table.seq[slots], table.version[slots],
                             table.prev[slots], table.back[slots]])  # fmt: skip
            leaves = sampler.leaves()[slots].copy() if hasattr(sampler, "leaves") else None
            manifest: dict[str, Any] = {
                "format": FORMAT, "format_version": FORMAT_VERSION, "checksum": CHECKSUM,
                "schema": table.schema.to_wire(), "capacity": table.capacity, "settings": settings,
                "table": table.state(), "sampler": sampler.state(), "limiter": core.limiter.state(),
                "files": {},
            }  # fmt: skip
        tmp.mkdir(parents=True)
        files = manifest["files"]
        for i, (spec, rows) in enumerate(zip(table.schema.fields, table.rows)):
            dtype, shape = DTYPES[spec.dtype], (held, *spec.shape)
            views = [rows[s : s + k].reshape(-1) for s, k in runs]  # never a copy of the table
            files[f"field_{i}.npy"] = _write(tmp / f"field_{i}.npy", dtype, shape, views)
        files["meta.npy"] = _write(tmp / "meta.npy", meta.dtype, meta.shape, [meta.view(np.uint8).reshape(-1)])
        if leaves is not None:
            files["priority.npy"] = _write(tmp / "priority.npy", leaves.dtype, leaves.shape, [leaves.view(np.uint8)])
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        _replace(tmp, path)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        core.resume()


def _write(file: Path, dtype: np.dtype, shape: tuple[int, ...], chunks: list[np.ndarray]) -> dict[str, Any]:
    digest = xxhash.xxh3_128()
    with open(file, "wb", buffering=0) as f:
        head = io.BytesIO()
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_2_0(head, header)
        digest.update(head.getvalue())
        f.write(head.getvalue())
        for data in chunks:
            for lo in range(0, data.size, _CHUNK):
                part = memoryview(data[lo : lo + _CHUNK])
                digest.update(part)
                f.write(part)
        os.fsync(f.fileno())
        size = f.tell()
    return {"bytes": size, CHECKSUM: digest.hexdigest()}


def _data_bytes(dtype: Any, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; an older checkpoint there is removed only afterwards."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- loading ---------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of the checkpoint at ``path``."""
    file = Path(path) / "manifest.json"
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is not a replay checkpoint (no manifest.json)") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not an rlink replay manifest")
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("checksum") != CHECKSUM:
        raise CheckpointError(f"{file}: format version {manifest.get('format_version')!r} is not supported "
                              f"(this library reads {FORMAT_VERSION})")  # fmt: skip
    try:
        Schema.from_wire(manifest["schema"])
        for key in ("capacity", "settings", "table", "sampler", "limiter", "files"):
            manifest[key]  # a missing key is a KeyError, reported below
    except Exception as exc:  # any malformed manifest is one error for the caller
        raise CheckpointError(f"{file} is malformed: {exc!r}") from exc
    return manifest


def restore(core: ReplayCore, path: str | os.PathLike[str], manifest: dict[str, Any]) -> None:
    """Fill a fresh ``core`` (not yet shared with any thread) from the checkpoint."""
    path = Path(path)
    schema = Schema.from_wire(manifest["schema"])
    core.build(schema, touch=False)
    table, sampler = core.table, core.sampler
    assert table is not None and sampler is not None
    try:
        table.restore(manifest["table"])
        if not 0 <= table.held <= table.capacity or table.held > table.inserted:
            raise CheckpointError(f"{path}: counters do not fit a table of capacity {table.capacity}")
        runs = table.id_order_runs()
        for i, (spec, rows) in enumerate(zip(schema.fields, table.rows)):
            views = [rows[s : s + k].reshape(-1) for s, k in runs]
            _read(path, f"field_{i}.npy", manifest, DTYPES[spec.dtype], (table.held, *spec.shape), views)
        meta = np.empty((5, table.held), dtype=np.int64)
        _read(path, "meta.npy", manifest, meta.dtype, meta.shape, [meta.view(np.uint8).reshape(-1)])
        leaves = None
        if "priority.npy" in manifest["files"]:
            leaves = np.empty(table.held, dtype=np.float64)
            _read(path, "priority.npy", manifest, leaves.dtype, leaves.shape, [leaves.view(np.uint8)])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} is malformed: {exc!r}") from exc
    slots = np.concatenate([np.arange(s, s + k) for s, k in runs] or [np.zeros(0, np.int64)])
    table.actor_id[slots], table.seq[slots], table.version[slots], table.prev[slots], table.back[slots] = meta
    sampler.restore(manifest["sampler"], leaves)
    limiter = manifest["limiter"]
    core.limiter.inserted, core.limiter.sampled = int(limiter["inserted"]), int(limiter["sampled"])


def _read(path: Path, name: str, manifest: dict[str, Any], dtype: Any, shape: tuple[int, ...],
          views: list[np.ndarray]) -> None:  # fmt: skip
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: the manifest lists no {name}")
    file = path / name
    try:
        size = file.stat().st_size
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: {name} is missing") from exc
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
    digest = xxhash.xxh3_128()
    with open(file, "rb", buffering=0) as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f"npy format version {version}")
            header = read_header[version](f, max_header_size=10_000)  # literals only, never pickle
        except ValueError as exc:
            raise CheckpointError(f"{path}: {name} has no valid .npy header: {exc}") from exc
        if header != (tuple(shape), False, np.dtype(dtype)):
            raise CheckpointError(f"{path}: {name} holds {header}, expected shape {shape} of {np.dtype(dtype)}")
        header_bytes = f.tell()
        if size - header_bytes != _data_bytes(dtype, shape):
            raise CheckpointError(f"{path}: {name} is {size} bytes, not header + data (truncated?)")
        f.seek(0)
        digest.update(f.read(header_bytes))
        for view in views:
            for lo in range(0, view.size, _CHUNK):
                part = memoryview(view[lo : lo + _CHUNK])
                if f.readinto(part) != len(part):
                    raise CheckpointError(f"{path}: {name} ended early (truncated)")
                digest.update(part)
    if digest.hexdigest() != entry[CHECKSUM]:
        raise CheckpointError(f"{path}: {name} does not match its checksum (corrupted)")

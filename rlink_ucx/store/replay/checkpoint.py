"""Replay checkpoints: a directory of raw ``.npy`` arrays and a JSON manifest, never pickle.

``save`` pauses inserts (the actors wait on credit meanwhile; sampling goes on), copies the
small state (counters, metadata, priorities) under the lock, then streams each field's rows
straight from the table to its file in 8 MiB chunks, oldest step first, hashing each chunk
with XXH3-128 just before writing it (the chunk is then still in the CPU's cache when
``write`` copies it). Right after each write it asks the kernel to start writing that range
back (``posix_fadvise(DONTNEED)`` does this for dirty pages), so the disk works while the next
chunks are copied instead of all at the final ``fsync``, and a few chunks later the same call
drops the range's then clean pages: a save does not fill the page cache with the table.
Files are created mode 0600 in a directory of mode 0700 (``private_files.py``, as token files,
whatever the umask): the trajectories are as private as the token that let their actors in.
They go to a temporary directory that is renamed to ``path`` at the end (then the parent
directory is fsynced), so a crash leaves either the old checkpoint or the new one; the old one
is removed by a background thread, which the next save and the interpreter's exit wait for.
``load`` reads each field with ``O_DIRECT`` straight into the new table (``direct_read.py``;
through the page cache where that is refused) while helper threads populate the table's pages
ahead of the reads (``storage.py``). It refuses a manifest of another format, a file whose
size, header or checksum differs (a truncated or corrupted checkpoint), a manifest that asks
for a table larger than the machine's available memory, and priorities that are not finite
and non-negative, with :class:`CheckpointError`; a table of another schema than the learner's
with ``SchemaMismatch``. The checksums find corruption, not tampering: anyone who can write
the directory can rewrite a file and its checksum, so a checkpoint is as trusted as the
directory it is kept in.
"""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ...errors import CheckpointError, ConfigError
from ...wire.codec import DTYPES, Schema
from ..private_files import create_private, make_private_dir
from .core import ReplayCore
from .direct_read import DirectReader

__all__ = ["CheckpointError", "read_manifest", "restore", "save", "wait_removals"]

FORMAT = "rlink-replay"
FORMAT_VERSION = 1
_CHUNK = 8 << 20  # bytes per hash + write: a chunk stays in the CPU's cache between the two
_READ_CHUNK = 8 << 20  # bytes per read + hash
_BEHIND = 4  # written chunks kept in the page cache before their (by then clean) pages are dropped
CHECKSUM = "xxh3_128"  # of each whole file, as `xxh128sum` prints it
_removals: list[threading.Thread] = []  # replaced checkpoints being removed


def save(core: ReplayCore, path: str | os.PathLike[str], settings: dict[str, Any]) -> dict[str, Any]:
    """Write a consistent snapshot of ``core`` to the directory ``path``; returns the manifest."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    wait_removals()  # at most the old checkpoint and the new one on disk at a time
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
        tmp.parent.mkdir(parents=True, exist_ok=True)
        make_private_dir(tmp)  # renamed to path: the checkpoint is its user's alone, as a token file
        files = manifest["files"]
        for i, spec in enumerate(table.schema.fields):
            dtype, shape = DTYPES[spec.dtype], (held, *spec.shape)
            # views of the table (host storage) or two reused host buffers (a CUDA table): never a copy of it
            files[f"field_{i}.npy"] = _write(tmp / f"field_{i}.npy", dtype, shape, table.chunks(i, runs, _CHUNK))
        files["meta.npy"] = _write(tmp / "meta.npy", meta.dtype, meta.shape, _pieces(meta))
        if leaves is not None:
            files["priority.npy"] = _write(tmp / "priority.npy", leaves.dtype, leaves.shape, _pieces(leaves))
        with os.fdopen(create_private(tmp / "manifest.json"), "w") as f:
            f.write(json.dumps(manifest, indent=1))
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        _fsync_dir(tmp)
        _replace(tmp, path)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        core.resume()


def _write(file: Path, dtype: np.dtype, shape: tuple[int, ...], chunks: Iterable[np.ndarray]) -> dict[str, Any]:
    digest = xxhash.xxh3_128()
    with os.fdopen(create_private(file), "wb", buffering=0) as f:
        fd = f.fileno()
        head = io.BytesIO()
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_2_0(head, header)
        digest.update(head.getvalue())
        _write_all(f, memoryview(head.getvalue()))
        at = f.tell()
        written: collections.deque[tuple[int, int]] = collections.deque()
        for chunk in chunks:
            part = chunk.data.cast("B")
            digest.update(part)
            _write_all(f, part)
            _advise(fd, at, part.nbytes)  # dirty pages: starts their writeback now
            written.append((at, part.nbytes))
            at += part.nbytes
            if len(written) > _BEHIND:
                _advise(fd, *written.popleft())  # written back by now: drops the clean pages
        os.fsync(fd)
        _advise(fd, 0, 0)
        size = f.tell()
    return {"bytes": size, CHECKSUM: digest.hexdigest()}


def _write_all(f: Any, view: memoryview) -> None:
    while view.nbytes:
        view = view[f.write(view) :]


def _advise(fd: int, offset: int, length: int, advice: str = "POSIX_FADV_DONTNEED") -> None:
    """posix_fadvise; DONTNEED starts the writeback of dirty pages and drops clean ones (Linux)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, getattr(os, advice))
        except OSError:  # a file system that takes no advice: the final fsync does the writing back
            pass


def _pieces(array: np.ndarray) -> Iterator[np.ndarray]:
    """A contiguous host array's bytes in chunks of at most ``_CHUNK``."""
    flat = array.reshape(-1).view(np.uint8)
    for lo in range(0, flat.size, _CHUNK):
        yield flat[lo : lo + _CHUNK]


def _data_bytes(dtype: Any, shape: tuple[int, ...]) -> int:
    itemsize: int = np.dtype(dtype).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize


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
    _fsync_dir(path.parent)  # the rename itself is durable when save returns
    if old is not None:
        # Unlinking gigabytes takes the file system ~0.1 s per GB: not the caller's wait. Not a
        # daemon thread, so the interpreter finishes it before it exits.
        thread = threading.Thread(target=shutil.rmtree, args=(old,), kwargs={"ignore_errors": True},
                                  name="rlink-replay-remove")  # fmt: skip
        thread.start()
        _removals.append(thread)


def wait_removals() -> None:
    """Wait until the checkpoints replaced by earlier saves are removed."""
    while _removals:
        _removals.pop().join()


# --- loading ---------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of the checkpoint at ``path``."""
    file = Path(path) / "manifest.json"
    try:
        with open(file, "rb") as fh:
            text = fh.read(_MAX_MANIFEST + 1)
        if len(text) > _MAX_MANIFEST:
            raise ValueError(f"over {_MAX_MANIFEST} bytes")
        manifest = json.loads(text)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is not a replay checkpoint (no manifest.json)") from exc
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than any manifest's
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
        schema = Schema.from_wire(manifest["schema"])
        capacity = int(manifest["settings"]["capacity"])
    except Exception as exc:  # any malformed manifest is one error for the caller
        raise CheckpointError(f"{file} is malformed: {exc!r}") from exc
    # The table is allocated before any file is read: a manifest must not make it larger than
    # this machine can hold (a checksum is no MAC; see the module docstring).
    need = capacity * (schema.step_bytes + _ROW_OVERHEAD)
    available = _available_memory()
    if capacity < 1 or (available is not None and need > available):
        raise CheckpointError(f"{file}: a table of capacity {capacity} needs {need / 2**30:.2f} GiB, more than this "
                              f"machine has available ({(available or 0) / 2**30:.2f} GiB)")  # fmt: skip
    return manifest


_MAX_MANIFEST = 16 << 20  # bytes; a real manifest is a few KiB
_ROW_OVERHEAD = 5 * 8 + 8  # per step: actor id, seq, version, prev, back, and a priority


def _available_memory() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


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
        for i, spec in enumerate(schema.fields):
            sinks = table.sinks(i, runs, _READ_CHUNK)  # the table itself (host) or reused host buffers (CUDA)
            _read(path, f"field_{i}.npy", manifest, DTYPES[spec.dtype], (table.held, *spec.shape), sinks, direct=True)
        meta = np.empty((5, table.held), dtype=np.int64)
        _read(path, "meta.npy", manifest, meta.dtype, meta.shape, _pieces(meta))
        leaves = None
        if "priority.npy" in manifest["files"]:
            leaves = np.empty(table.held, dtype=np.float64)
            _read(path, "priority.npy", manifest, leaves.dtype, leaves.shape, _pieces(leaves))
            if not (np.isfinite(leaves).all() and (leaves >= 0).all()):
                raise CheckpointError(f"{path}: priority.npy holds NaN, infinite or negative priorities")
        max_priority = float(manifest["sampler"].get("max_priority", 1.0))
        if not (np.isfinite(max_priority) and max_priority > 0):
            raise CheckpointError(f"{path}: the sampler's max_priority {max_priority!r} is not a positive number")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} is malformed: {exc!r}") from exc
    slots = np.concatenate([np.arange(s, s + k) for s, k in runs] or [np.zeros(0, np.int64)])
    table.actor_id[slots], table.seq[slots], table.version[slots], table.prev[slots], table.back[slots] = meta
    sampler.restore(manifest["sampler"], leaves)
    limiter = manifest["limiter"]
    core.limiter.inserted, core.limiter.sampled = int(limiter["inserted"]), int(limiter["sampled"])


def _read(path: Path, name: str, manifest: dict[str, Any], dtype: Any, shape: tuple[int, ...],
          sinks: Iterable[np.ndarray], direct: bool = False) -> None:  # fmt: skip
    """Check ``name``'s size and header, stream its data into ``sinks`` and check its checksum.
    ``direct``: the sinks have guard space around them (``storage.py``), so the data is read
    with ``O_DIRECT`` where the file system allows it."""
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
        _advise(f.fileno(), 0, 0, "POSIX_FADV_SEQUENTIAL")  # a larger read-ahead (buffered reads)
        reader = DirectReader.open(file) if direct else None
        at = header_bytes
        try:
            for sink in sinks:
                part = sink.data.cast("B")
                if reader is not None:
                    try:
                        complete = reader.read_into(sink, at) == part.nbytes
                    except OSError:  # the device wants other alignment: the rest goes through the page cache
                        reader.close()
                        reader = None
                        f.seek(at)
                if reader is None:
                    complete = _read_all(f, part)
                if not complete:
                    raise CheckpointError(f"{path}: {name} ended early (truncated)")
                digest.update(part)
                at += part.nbytes
        finally:
            if reader is not None:
                reader.close()
    if digest.hexdigest() != entry[CHECKSUM]:
        raise CheckpointError(f"{path}: {name} does not match its checksum (corrupted)")


def _read_all(f: Any, view: memoryview) -> bool:
    """Fill ``view`` from ``f``; False if the file ends first."""
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            return False
        view = view[n:]
    return True

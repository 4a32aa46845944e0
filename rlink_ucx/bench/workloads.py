"""What every system of the suite moves: the workloads (one uint8 array per step, or an RL step).

Every system sends chunks of ``Workload.chunk`` steps, one send call per chunk, each chunk
carrying a ``t_ns`` int64 field (``time.monotonic_ns()`` at the send call) next to the step's
own fields.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    """``fields``: (name, dtype, per-step shape); ``chunk``: steps per send call."""

    name: str
    fields: tuple[tuple[str, str, tuple[int, ...]], ...]
    chunk: int = 1
    kind: str = "bytes"  # "bytes" (one uint8 array per step) or "rl" (an RL step)

    @property
    def size_bytes(self) -> int:
        """Payload bytes per step (without ``t_ns``)."""
        return sum(np.dtype(d).itemsize * math.prod(s) for _, d, s in self.fields)

    @property
    def wire_step_bytes(self) -> int:
        return self.size_bytes + 8

    def chunk_arrays(self, k: int | None = None, fill: int | None = None) -> dict[str, np.ndarray]:
        k = self.chunk if k is None else k
        rng = np.random.default_rng(1)
        out = {}
        for name, dtype, shape in self.fields:
            if fill is not None:
                out[name] = np.full((k, *shape), fill, dtype=dtype)
            elif np.dtype(dtype) == np.uint8:
                out[name] = rng.integers(0, 255, (k, *shape), dtype=np.uint8)
            else:
                out[name] = rng.random((k, *shape)).astype(dtype)
        return out

    def with_chunk(self, chunk: int) -> Workload:
        return dataclasses.replace(self, chunk=chunk)


def bytes_workload(name: str, size: int) -> Workload:
    return Workload(name, (("x", "uint8", (size,)),))


ATARI = Workload("atari", (("obs", "uint8", (4, 84, 84)), ("action", "int64", ()), ("reward", "float32", ()),
                           ("done", "bool", ())), kind="rl")  # fmt: skip
CARTPOLE = Workload("cartpole", (("obs", "float32", (4,)), ("action", "int64", ()), ("reward", "float32", ()),
                                 ("done", "bool", ())), kind="rl")  # fmt: skip
WORKLOADS = {
    "1KiB": bytes_workload("1KiB", 1 << 10),
    "4KiB": bytes_workload("4KiB", 4 << 10),
    "16KiB": bytes_workload("16KiB", 16 << 10),
    "64KiB": bytes_workload("64KiB", 64 << 10),
    "1MiB": bytes_workload("1MiB", 1 << 20),
    "16MiB": bytes_workload("16MiB", 16 << 20),
    "atari": ATARI,
    "cartpole": CARTPOLE,
}


def flat_bytes(arr: np.ndarray) -> np.ndarray:
    """A 1-D uint8 view of a C-contiguous array (same memory)."""
    return arr.reshape(-1).view(np.uint8)

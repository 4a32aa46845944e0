"""``torch-gloo``: ProcessGroupGloo ``send``/``recv`` of each field as a flat uint8 tensor, in a
two-rank group made with rlink's own process-group helpers.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rlink_ucx.bench.harness import Receiver, Sender, run_session
from rlink_ucx.bench.measure import Recorder, Timing
from rlink_ucx.bench.workloads import Workload, flat_bytes


def _gloo_group(store: Any, rank: int, timeout: float) -> Any:
    from rlink_ucx.bench.process_group import new_group

    return new_group(store, "bench/", rank, 2, backend="gloo", hostname="127.0.0.1", timeout=timeout)


class GlooSender(Sender):
    """One ``send`` per field (tag = field index), as flat uint8 tensors; all waited for."""

    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        from rlink_ucx.bench.process_group import connect_store

        super().__init__(info, workload, index, timeout)
        self.group = _gloo_group(connect_store("127.0.0.1", info, timeout), 1, timeout)
        self.key: Any = None
        self.tensors: list[Any] = []
        self.delta = __import__("datetime").timedelta(seconds=timeout)

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        import torch

        if self.key is not t_ns:
            self.key = t_ns
            self.tensors = [torch.from_numpy(flat_bytes(a)) for a in (t_ns, *arrays.values())]
        works = [self.group.send([t], 0, i) for i, t in enumerate(self.tensors)]
        for w in works:
            w.wait(self.delta)


class GlooReceiver(Receiver):
    def __init__(self, workload: Workload, timeout: float):
        import datetime

        import torch

        from rlink_ucx.bench.process_group import serve_store

        self.store, self.port = serve_store("127.0.0.1", timeout)
        self.chunk = workload.chunk
        self.t_ns = np.zeros(workload.chunk, np.int64)
        arrays = workload.chunk_arrays(fill=0)
        self.tensors = [torch.from_numpy(flat_bytes(a)) for a in (self.t_ns, *arrays.values())]
        self.delta = datetime.timedelta(seconds=timeout)
        self.group: Any = None

    def info(self) -> Any:
        return self.port

    def accept(self, actors: int, timeout: float) -> None:
        self.group = _gloo_group(self.store, 0, timeout)

    def recv(self, rec: Recorder) -> int:
        works = [self.group.recv([t], 1, i) for i, t in enumerate(self.tensors)]
        for w in works:
            w.wait(self.delta)
        return rec.stamp(time.monotonic_ns(), self.chunk, int(self.t_ns[0]))

    def close(self) -> None:
        self.group = None
        self.store = None


def run_gloo(workload: Workload, timing: Timing) -> dict[str, Any]:
    return run_session(GlooReceiver(workload, timing.timeout), f"{__name__}:GlooSender", workload, timing)

"""``raw-ucxx``: ucxx's low-level tag send/recv, the substrate of rlink's ucx plane, on a worker
made like rlink's own (same UCX options): one ``tag_send`` per field, two chunks' receives posted.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .harness import Receiver, Sender, run_session
from .measure import Recorder, Timing
from .workloads import Workload, flat_bytes

UCX_TAG = 0x5EED << 32


def _ucx_worker() -> tuple[Any, Any, Any, Any]:
    """A worker made exactly like rlink's ucx plane makes its own (same UCX options)."""
    from .. import Config
    from ..transport.ucx import load_ucxx, make_worker

    u, context, worker = make_worker(Config.from_env())
    return u, load_ucxx()[1], context, worker


def ucx_wait(worker: Any, requests: list[Any], timeout: float, what: str = "ucx") -> None:
    """Progress ``worker`` until every request completed (raising its error), or ``timeout``."""
    deadline = time.monotonic() + timeout
    spins = 0
    while not all(r.completed for r in requests):
        worker.progress()
        spins += 1
        if spins % 256 == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"{what}: ucx requests did not complete within {timeout}s")
    for r in requests:
        r.check_error()


class UcxxSender(Sender):
    """One ``tag_send`` per field (tag = field index), waited for before the next chunk."""

    markers = 2  # the receiver keeps two messages' receives posted

    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        super().__init__(info, workload, index, timeout)
        self.u, self.Array, self._context, self.worker = _ucx_worker()
        address = self.u.UCXAddress.create_from_buffer(info)
        self.ep = self.u.UCXEndpoint.create_from_worker_address(self.worker, address, False)
        self.tags = [self.u.UCXXTag(UCX_TAG | i) for i in range(len(workload.fields) + 1)]
        self.key: Any = None
        self.bufs: list[Any] = []

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        if self.key is not t_ns:
            self.key = t_ns
            self.bufs = [self.Array(flat_bytes(t_ns))] + [self.Array(flat_bytes(a)) for a in arrays.values()]
        ep = self.ep
        requests = [ep.tag_send(b, tag) for b, tag in zip(self.bufs, self.tags)]
        ucx_wait(self.worker, requests, self.timeout)

    def close(self) -> None:
        self.ep.close_blocking(10**9, 1)


class UcxxReceiver(Receiver):
    def __init__(self, workload: Workload, timeout: float):
        self.u, self.Array, self._context, self.worker = _ucx_worker()
        self.timeout = timeout
        self.chunk = workload.chunk
        self.tags = [self.u.UCXXTag(UCX_TAG | i) for i in range(len(workload.fields) + 1)]
        self.slots = []
        for _ in range(2):
            t_ns = np.zeros(workload.chunk, np.int64)
            arrays = workload.chunk_arrays(fill=0)
            buffers = [self.Array(flat_bytes(t_ns))] + [self.Array(flat_bytes(a)) for a in arrays.values()]
            self.slots.append((t_ns, buffers, arrays))
        self.requests: list[list[Any]] = [[], []]
        self.cur = 0

    def info(self) -> Any:
        return bytes(self.worker.address.tobytes())

    def _post(self, slot: int) -> None:
        self.requests[slot] = [self.worker.tag_recv(b, tag) for b, tag in zip(self.slots[slot][1], self.tags)]

    def accept(self, actors: int, timeout: float) -> None:
        self._post(0)
        self._post(1)

    def recv(self, rec: Recorder) -> int:
        cur = self.cur
        ucx_wait(self.worker, self.requests[cur], self.timeout)
        now = time.monotonic_ns()
        t = int(self.slots[cur][0][0])
        self.requests[cur] = []
        if t < 0:  # the sender sends two markers: drain the other slot too
            ucx_wait(self.worker, self.requests[cur ^ 1], self.timeout)
            self.requests[cur ^ 1] = []
            return 1
        rec.add(now, self.chunk, now - t)
        self._post(cur)
        self.cur = cur ^ 1
        return 0

    def close(self) -> None:
        if any(self.requests):
            try:
                self.worker.cancel_inflight_requests()
                for _ in range(100):
                    self.worker.progress()
            except Exception:  # noqa: BLE001 - best effort after a failure
                pass


def run_raw_ucxx(workload: Workload, timing: Timing) -> dict[str, Any]:
    return run_session(UcxxReceiver(workload, timing.timeout), f"{__name__}:UcxxSender", workload, timing)

"""``raw-ucxx``: ucxx's low-level tag send/recv, the substrate of rlink's ucx plane, on a worker
made like rlink's own (same UCX options): one ``tag_send`` per field, two chunks' receives posted
per sender (each sender's messages carry its index in their tags).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlink_ucx.bench.harness import Receiver, Sender, run_session
from rlink_ucx.bench.measure import Recorder, Timing
from rlink_ucx.bench.workloads import Workload, flat_bytes
from rlink_ucx.transport.ucx.setup import SPINS_BEFORE_YIELD  # yield as rlink's plane does (no ucxx import here)

UCX_TAG = 0x5EED << 32


def _tag(sender: int, field: int) -> int:
    return UCX_TAG | sender << 8 | field


def _ucx_worker() -> tuple[Any, Any, Any, Any]:
    """A worker made exactly like rlink's ucx plane makes its own (same UCX options)."""
    from rlink_ucx import Config
    from rlink_ucx.transport.ucx.learner import load_ucxx, make_worker

    u, context, worker = make_worker(Config.from_env())
    return u, load_ucxx()[1], context, worker


def _spin(worker: Any, ready: Callable[[], Any], timeout: float, what: str) -> Any:
    """Progress ``worker`` until ``ready()`` returns something other than None (returned),
    yielding the core after ``SPINS_BEFORE_YIELD`` empty polls as rlink's ucx plane does (with
    more processes than cores, senders spinning flat out starve the receiver they wait for: 4
    senders on 2 cores, 4.2-4.5 GB/s of Atari steps without yielding, 11.5-11.8 with);
    TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    spins = 0
    while (found := ready()) is None:
        worker.progress()
        spins += 1
        if spins > SPINS_BEFORE_YIELD:
            os.sched_yield()
        if spins % 256 == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout}s")
    return found


def ucx_wait(worker: Any, requests: list[Any], timeout: float, what: str = "ucx") -> None:
    """Progress ``worker`` until every request completed (raising its error), or ``timeout``."""
    _spin(worker, lambda: True if all(r.completed for r in requests) else None, timeout,
          f"{what}: ucx requests did not complete")  # fmt: skip
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
        self.tags = [self.u.UCXXTag(_tag(index, i)) for i in range(len(workload.fields) + 1)]
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
    """Two chunks' receives posted per sender; takes whichever sender's current chunk is in
    first (in turn from the last one served, so no sender is starved)."""

    def __init__(self, workload: Workload, timeout: float, senders: int = 1):
        self.u, self.Array, self._context, self.worker = _ucx_worker()
        self.timeout = timeout
        self.chunk = workload.chunk
        fields = len(workload.fields) + 1
        self.tags = [[self.u.UCXXTag(_tag(s, i)) for i in range(fields)] for s in range(senders)]
        self.slots = []  # per sender, two chunks: (t_ns, buffers, arrays)
        for _ in range(senders):
            pair = []
            for _ in range(2):
                t_ns = np.zeros(workload.chunk, np.int64)
                arrays = workload.chunk_arrays(fill=0)
                buffers = [self.Array(flat_bytes(t_ns))] + [self.Array(flat_bytes(a)) for a in arrays.values()]
                pair.append((t_ns, buffers, arrays))
            self.slots.append(pair)
        self.requests: list[list[list[Any]]] = [[[], []] for _ in range(senders)]
        self.cur = [0] * senders
        self.live = list(range(senders))  # senders whose end marker has not come yet
        self.turn = 0

    def info(self) -> Any:
        return bytes(self.worker.address.tobytes())

    def _post(self, sender: int, slot: int) -> None:
        buffers = self.slots[sender][slot][1]
        self.requests[sender][slot] = [self.worker.tag_recv(b, tag) for b, tag in zip(buffers, self.tags[sender])]

    def accept(self, actors: int, timeout: float) -> None:
        assert actors == len(self.slots), f"receives posted for {len(self.slots)} senders, {actors} started"
        for sender in range(len(self.slots)):
            self._post(sender, 0)
            self._post(sender, 1)

    def recv(self, rec: Recorder) -> int:
        sender = _spin(self.worker, self._next_in, self.timeout, "raw-ucxx: no sender's chunk came")
        return self._take(sender, rec)

    def _next_in(self) -> int | None:
        """The first sender, in turn from the last one served, whose current chunk is in."""
        n = len(self.live)
        for k in range(n):
            sender = self.live[(self.turn + k) % n]
            if all(r.completed for r in self.requests[sender][self.cur[sender]]):
                self.turn = (self.turn + k + 1) % n
                return sender
        return None

    def _take(self, sender: int, rec: Recorder) -> int:
        cur = self.cur[sender]
        for r in self.requests[sender][cur]:
            r.check_error()
        now = time.monotonic_ns()
        t = int(self.slots[sender][cur][0][0])
        self.requests[sender][cur] = []
        if t < 0:  # the sender sends two markers: drain the other slot too
            ucx_wait(self.worker, self.requests[sender][cur ^ 1], self.timeout)
            self.requests[sender][cur ^ 1] = []
            self.live.remove(sender)
            self.turn = 0
            return 1
        rec.add(now, self.chunk, now - t)
        self._post(sender, cur)
        self.cur[sender] = cur ^ 1
        return 0

    def close(self) -> None:
        if any(any(pair) for pair in self.requests):
            try:
                self.worker.cancel_inflight_requests()
                for _ in range(100):
                    self.worker.progress()
            except Exception:  # noqa: BLE001, S110 - best effort after a failure
                pass


def run_raw_ucxx(workload: Workload, timing: Timing, senders: int = 1) -> dict[str, Any]:
    return run_session(UcxxReceiver(workload, timing.timeout, senders), f"{__name__}:UcxxSender", workload, timing,
                       senders)  # fmt: skip

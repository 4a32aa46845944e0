"""``pyzmq-copy`` / ``pyzmq-zerocopy``: a PUSH/PULL pair, one multipart message per chunk
(``t_ns`` and each field a part), sent with ``copy=True`` / ``copy=False``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from rlink_ucx.bench.harness import Receiver, Sender, run_session
from rlink_ucx.bench.measure import Recorder, Timing
from rlink_ucx.bench.workloads import Workload

MiB = 1 << 20


def _zmq_hwm(workload: Workload) -> int:
    """Bound what zmq queues to about 64 MiB per side (the default 1000 messages of 16 MiB would be 16 GB)."""
    return max(2, min(1000, (64 * MiB) // (workload.chunk * workload.wire_step_bytes)))


class ZmqSender(Sender):
    def __init__(self, info: Any, workload: Workload, index: int, timeout: float):
        import zmq

        super().__init__(info, workload, index, timeout)
        endpoint, self.copy = info
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, _zmq_hwm(workload))
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.LINGER, int(timeout * 1000))
        self.sock.connect(endpoint)

    def send(self, t_ns: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        if self.copy:
            self.sock.send_multipart([t_ns, *arrays.values()], copy=True)
        else:  # zmq keeps a reference until sent: t_ns is refilled in place, so send a copy of it
            self.sock.send_multipart([t_ns.copy(), *arrays.values()], copy=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class ZmqReceiver(Receiver):
    def __init__(self, workload: Workload, copy: bool, timeout: float):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, _zmq_hwm(workload))
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.copy = copy
        self.chunk = workload.chunk
        self.fields = [(np.dtype(d), s) for _, d, s in workload.fields]

    def info(self) -> Any:
        return (self.endpoint, self.copy)

    def recv(self, rec: Recorder) -> int:
        parts = self.sock.recv_multipart(copy=self.copy)
        now = time.monotonic_ns()
        t = int(np.frombuffer(parts[0] if self.copy else parts[0].buffer, np.int64, count=1)[0])
        # what a consumer would do: numpy views of the fields (no copy)
        for part, (dtype, shape) in zip(parts[1:], self.fields):
            np.frombuffer(part if self.copy else part.buffer, dtype).reshape(self.chunk, *shape)
        return rec.stamp(now, self.chunk, t)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def run_zmq(workload: Workload, timing: Timing, copy: bool) -> dict[str, Any]:
    return run_session(ZmqReceiver(workload, copy, timing.timeout), f"{__name__}:ZmqSender", workload, timing)

"""The scale benchmark's learner process: fetches every step, measures latency, CPU, RSS and fds."""

from __future__ import annotations

import os
import queue
import time
from typing import Any

import numpy as np

from .scale_process import CpuWindow, open_fds, rss_mib, wait_message

FETCH_TIMEOUT = 0.05  # the learner's fetch slice: commands are looked at between fetches


def learner_process(reports: Any, transport: str, batch_size: int, cmd: Any, timeout: float) -> None:
    """Run under ``child_main``: listen, report ready, fetch until drained, report the result."""
    from .. import Config, Learner, RLinkDataset
    from .. import TimeoutError as FetchTimeout

    deadline = time.time() + timeout
    learner = Learner("127.0.0.1:0", transport=transport, config=Config.from_env())
    try:
        dataset = RLinkDataset(learner, batch_size=batch_size)
        tail = RLinkDataset(learner, batch_size=1)
        reports.put(("learner-ready", None, {"port": learner.port, "pid": os.getpid(), "rss_mib": rss_mib(),
                                             "fds": open_fds()}))  # fmt: skip
        actors: list[np.ndarray] = []
        seqs: list[np.ndarray] = []
        lat_ns: list[np.ndarray] = []
        put_ns: list[np.ndarray] = []
        window: CpuWindow | None = None
        connected: dict[str, Any] = {}
        source, draining = dataset, False
        while time.time() < deadline:
            try:
                msg = cmd.get_nowait()
            except queue.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "go":  # time the window; spread: every actor that will connect has, measure
                    if msg[3]:
                        connected = {"rss_mib": rss_mib(), "fds": open_fds()}
                    window = CpuWindow(msg[1], msg[2])
                    window.start()
                elif msg[0] == "measure":  # together: the last actor connected
                    connected = {"rss_mib": rss_mib(), "fds": open_fds()}
                elif msg[0] == "drain":  # every actor flushed: what is left is in the ring
                    source, draining = tail, True
                elif msg[0] == "stop":
                    return
            try:
                batch = source.fetch(timeout=0.2 if draining else FETCH_TIMEOUT)
            except FetchTimeout:
                if not draining:
                    continue
                break
            now = time.time_ns()
            put_ns.append(batch["t_ns"].numpy().astype(np.int64))
            lat_ns.append(now - put_ns[-1])
            actors.append(batch["actor"].numpy().astype(np.int64))
            seqs.append(batch["seq"].numpy().astype(np.int64))
        else:
            raise TimeoutError("the learner's time ran out before the drain")
        cpu, wall = window.result(5.0) if window is not None else (None, None)
        stats = learner.stats()

        def cat(xs: list[np.ndarray], dt: type) -> np.ndarray:
            return np.concatenate(xs) if xs else np.zeros(0, dt)

        reports.put(("learner-result", None, {
            "actor": cat(actors, np.int64), "seq": cat(seqs, np.int64), "lat_ns": cat(lat_ns, np.int64),
            "t_ns": cat(put_ns, np.int64),
            "cpu_s": cpu, "wall_s": wall, "connected": connected, "rss_end_mib": rss_mib(),
            "stats": {k: stats.get(k) for k in ("connected_actors", "lost_actors", "rejected_connections", "shed_handshakes",
                                                    "shed_handshakes_per_peer", "preauth_timeouts")},
        }))  # fmt: skip
        wait_message(cmd, deadline)  # "stop": the actors are closed by then
    finally:
        learner.close()

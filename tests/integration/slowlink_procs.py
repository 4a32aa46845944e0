"""Processes of the slow-link test (test_slow_link.py), each run in a network namespace.

Every step carries who sent it (``who``), its index in that sender's stream (``i``) and the
sender's clock when it was put (``t``, microseconds): the learner, on the same host clock, records
each step's put->fetch latency as it fetches it.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

OBS = 1024  # float32s per step: 4 KiB, so a 2 Mbit/s link carries about 60 steps a second
FRAME_TIMEOUT = 3.0  # the learner's Config.frame_timeout; the trickler holds each frame just under it


def _step(who: int, i: int) -> dict[str, np.ndarray]:
    return {"obs": np.full(OBS, i, dtype=np.float32), "who": np.int64(who), "i": np.int64(i),
            "t": np.int64(time.time_ns() // 1000)}  # fmt: skip (microseconds: a float field may travel as float32)


def learner(address_path: str, stop_path: str, result_path: str) -> None:
    """Fetch steps one at a time until ``stop_path`` exists and nothing more comes."""
    from rlink_ucx import Config, Learner, RLinkDataset
    from rlink_ucx import TimeoutError as RLinkTimeout

    config = Config(frame_timeout=FRAME_TIMEOUT)
    got: list[tuple[int, int, float]] = []  # (who, i, put->fetch seconds)
    with Learner("10.77.0.1:0", token=os.environ["RLINK_TOKEN"], transport="tcp", config=config) as lrn:
        with open(address_path + ".tmp", "w") as f:
            f.write(lrn.address)
        os.rename(address_path + ".tmp", address_path)
        dataset = RLinkDataset(lrn, batch_size=1, format="numpy")
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            try:
                batch = dataset.fetch(timeout=1.0)
            except RLinkTimeout:
                if os.path.exists(stop_path):
                    break
                continue
            now = time.time_ns() // 1000
            got += [(int(w), int(i), (now - int(t)) * 1e-6) for w, i, t in zip(batch["who"], batch["i"], batch["t"])]
    with open(result_path, "w") as f:
        json.dump({"steps": got}, f)


def fast_actor(address: str, who: int, n: int, result_path: str) -> None:
    """``n`` steps at 20 a second."""
    from rlink_ucx import Actor

    with Actor(address, token=os.environ["RLINK_TOKEN"], transport="tcp", actor_id=who) as actor:
        start = time.monotonic()
        for i in range(n):
            time.sleep(max(0.0, start + i / 20 - time.monotonic()))
            actor.put(_step(who, i))
        actor.flush(60)
    with open(result_path, "w") as f:
        json.dump({"sent": n}, f)


def slow_actor(address: str, who: int, stop_path: str, result_path: str, trickle: bool) -> None:
    """Put steps as fast as the link (or the trickle) lets it until ``stop_path`` exists.

    ``trickle``: every frame goes out but its last byte, which follows just under the
    learner's ``frame_timeout`` later (a patched sender; the actor is otherwise honest)."""
    from rlink_ucx import Actor, Config
    from rlink_ucx.transport.tcp import stream as tcp
    if trickle:
        def send(self: tcp.TcpSender, header: bytes, payload: list[memoryview]) -> None:
            data = b"".join([header, *payload])
            self.sock.sendall(data[:-1])
            time.sleep(FRAME_TIMEOUT - 0.6)
            self.sock.sendall(data[-1:])

        tcp.TcpSender.send = send  # type: ignore[method-assign]
    config = Config(frame_bytes=128 << 10, resend_buffer_bytes=1 << 20, reconnect_timeout=30)
    with Actor(address, token=os.environ["RLINK_TOKEN"], transport="tcp", actor_id=who, config=config) as actor:
        i = 0
        while not os.path.exists(stop_path):
            if trickle:  # a frame of 32 steps at once (one step at a time would make 1-step frames)
                steps = [_step(who, j) for j in range(i, i + 32)]
                actor.put_many({k: np.stack([s[k] for s in steps]) for k in steps[0]})
                i += 32
            else:
                actor.put(_step(who, i))
                i += 1
        actor.flush(60)
    with open(result_path, "w") as f:
        json.dump({"sent": i}, f)

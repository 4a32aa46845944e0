"""Code that runs in spawned actor processes (importable by the children)."""

from __future__ import annotations

import time

import numpy as np


def encoded_steps(actor: int, n: int) -> dict[str, np.ndarray]:
    """Steps whose values encode (actor, seq), so the learner can check every byte."""
    seq = np.arange(n, dtype=np.int64)
    return {
        "obs": np.stack([np.full(n, actor, np.float32), seq.astype(np.float32), (seq * 0.5).astype(np.float32)], 1),
        "action": actor * 1_000_000 + seq,
        "reward": (seq % 7).astype(np.float16),
        "done": seq % 11 == 0,
    }


def version_of(seq: int) -> int:
    return seq // 1000


def stream_actor(address: str, transport: str, actor: int, n: int, mode: str = "mixed") -> None:
    """Put ``n`` encoded steps: single puts and put_many chunks, with changing versions."""
    from rlink_ucx import Actor

    steps = encoded_steps(actor, n)
    with Actor(address, transport=transport, actor_id=actor) as a:
        seq = 0
        while seq < n:
            if mode == "mixed" and (seq // 500) % 2 == 0:  # single steps
                a.put({k: v[seq] for k, v in steps.items()}, version=version_of(seq))
                seq += 1
            else:  # chunks that never straddle a version change
                k = min(37, n - seq, 1000 - seq % 1000)
                a.put_many({f: v[seq : seq + k] for f, v in steps.items()}, version=version_of(seq))
                seq += k
        a.flush(60)


def large_field_steps(actor: int, n: int) -> dict[str, np.ndarray]:
    """Steps with two fields too large to ride in a ucx frame's header message (12 KiB and
    6 KiB a step) and a small one; the bytes encode (actor, seq, field)."""
    seq = np.arange(n, dtype=np.int64)[:, None]
    return {
        "obs": ((seq * 7 + actor + np.arange(12288)) % 251).astype(np.uint8),
        "mask": (seq * 1000 + actor * 10_000_000 + np.arange(1536)).astype(np.float32),
        "reward": (seq[:, 0] * 3 + actor).astype(np.int32),
    }


def large_field_actor(address: str, transport: str, actor: int, n: int) -> None:
    """Put ``n`` large-field steps: single puts (frames of one or a few steps) and put_many chunks."""
    from rlink_ucx import Actor

    steps = large_field_steps(actor, n)
    with Actor(address, transport=transport, actor_id=actor) as a:
        seq = 0
        while seq < n:
            k = 1 if (seq // 50) % 2 == 0 else min(13, n - seq)
            a.put_many({f: v[seq : seq + k] for f, v in steps.items()})
            seq += k
        a.flush(60)


def int_actor(address: str, actor: int, n: int) -> None:
    """Put int64 steps 0..n-1 in chunks of 100 over tcp."""
    from rlink_ucx import Actor

    with Actor(address, transport="tcp", actor_id=actor) as a:
        for start in range(0, n, 100):
            a.put_many({"x": np.arange(start, start + 100, dtype=np.int64)})
        a.flush(30)


def lingering_actor(address: str, transport: str, n: int) -> None:
    """Tiny frames and a 1 ms linger: full-frame hand-offs race the linger tick constantly."""
    from rlink_ucx import Actor, Config

    config = Config(frame_bytes=2048, frame_linger=0.001)
    with Actor(address, transport=transport, actor_id=9, config=config) as a:
        for start in range(0, n, 50):
            a.put_many({"x": np.arange(start, start + 50, dtype=np.int64)})
            if start % 1000 == 0:
                a.put({"x": np.int64(-1)})  # a lone step leaves a partial frame for the tick
        a.flush(60)


def model_state(version: int) -> dict:
    """A small MLP's state dict whose values depend on ``version`` (float32 and bfloat16)."""
    import torch

    g = torch.Generator().manual_seed(version)
    return {
        "l1.weight": torch.randn(64, 8, generator=g),
        "l1.bias": torch.randn(64, generator=g),
        "l2.weight": torch.randn(2, 64, generator=g).to(torch.bfloat16),
        "l2.bias": torch.full((2,), float(version)),
        "steps": torch.tensor(version * 1000, dtype=torch.int64),
    }


def as_bytes(state: dict) -> dict:
    """Tensors as raw bytes, to compare bit for bit across processes."""
    import torch

    out = {}
    for k, t in state.items():
        t = t.detach().cpu().contiguous()
        out[k] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return out


def weights_actor(address: str, results, until: int, transport: str = "tcp", config: dict | None = None,
                  leave=None) -> None:  # fmt: skip
    """Subscribe, follow published versions until ``until``, report what was seen, and stay
    (a member leaving in the middle of another member's broadcast would break it) until
    ``leave`` is set."""
    from rlink_ucx import Actor, Config

    with Actor(address, transport=transport, subscribe=True, config=Config(**(config or {}))) as a:
        seen: list[int] = []
        while not seen or seen[-1] < until:
            state, version = a.get_remote_model(timeout=60, latest=False)  # ({}, 0): none here yet
            if version and (not seen or seen[-1] != version):
                seen.append(version)
            time.sleep(0.005)
        results.put({"actor_id": a.actor_id, "seen": seen, "state": as_bytes(state), "stats": a.stats()["weights"],
                     "policy_version": a.policy_version})  # fmt: skip
        if leave is not None:
            leave.wait(60)


def late_actor(address: str, results) -> None:
    """Connect after versions were published: one get must return the newest at once."""
    import torch

    from rlink_ucx import Actor

    with Actor(address, transport="tcp") as a:
        started = time.monotonic()
        state, version = a.get_remote_model(timeout=30)
        net = torch.nn.Module()
        for k, t in state.items():  # a module with the same names, to exercise load_remote_model
            net.register_buffer(k.replace(".", "_"), torch.zeros_like(t))
        results.put({"version": version, "state": as_bytes(state), "seconds": time.monotonic() - started,
                     "stats": a.stats()["weights"], "again": a.get_remote_model(timeout=1)[1]})  # fmt: skip


def stamped_actor(address: str, per_version: int, versions: list) -> None:
    """Put ``per_version`` int64 steps stamped with each version in ``versions``."""
    from rlink_ucx import Actor

    with Actor(address, transport="tcp") as a:
        for v in versions:
            a.put_many({"x": np.full(per_version, v, dtype=np.int64)}, version=v)
        a.flush(30)


def learner_in_default_group(results) -> None:
    """A learner whose process already has its own default group publishes to one actor."""
    import multiprocessing as mp
    import socket

    import torch
    import torch.distributed as dist

    from rlink_ucx import Learner

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    world_before = dist.group.WORLD
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=weights_actor, args=(learner.address, q, 2))
        p.start()
        deadline = time.monotonic() + 60
        while not any(a["subscribed"] for a in learner.stats()["actors"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        learner.publish(model_state(1), wait=True, timeout=30)
        learner.publish(model_state(2), wait=True, timeout=30)
        report = q.get(timeout=60)
        p.join(30)
        stats = learner.stats()["weights"]
    t = torch.ones(3)
    dist.all_reduce(t)
    results.put({
        "report": report,
        "expected": as_bytes(model_state(2)),
        "initialized": dist.is_initialized(),
        "same_world": dist.group.WORLD is world_before,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "all_reduce": t.tolist(),
        "streamed": stats["streamed"],
    })
    dist.destroy_process_group()


def restartable_learner(port: int, deliveries, batch: int = 20, transport: str = "tcp") -> None:
    """A learner on a fixed port that reports every delivered (actor, seq) until killed."""
    from rlink_ucx import Learner, RLinkDataset
    from rlink_ucx import TimeoutError as RLinkTimeout

    with Learner(f"127.0.0.1:{port}", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=batch)
        deliveries.put(("ready", learner.address))
        while True:
            try:
                b = dataset.fetch(timeout=1)
            except RLinkTimeout:
                continue
            deliveries.put(("steps", list(zip(b.actor_id.tolist(), b.seq.tolist(), b["x"].tolist()))))


def steady_actor(address: str, actor: int, n: int, chunk: int, results, large: bool = False,
                 transport: str = "tcp") -> None:  # fmt: skip
    """Stream x = seq in chunks, slowly enough to be caught mid-stream by a learner restart.
    ``large``: each chunk is a whole frame (sent zero-copy, kept for resending by copy)."""
    from rlink_ucx import Actor, Config

    frame = chunk * 8 if large else chunk * 8 * 4
    config = Config.from_env(reconnect_timeout=60, frame_bytes=frame, resend_large_puts=large)  # RLINK_* too
    with Actor(address, transport=transport, actor_id=actor, config=config) as a:
        for start in range(0, n, chunk):
            a.put_many({"x": np.arange(start, start + chunk, dtype=np.int64)})
            time.sleep(0.005)
        a.flush(60)
        results.put(a.stats())


def reused_array_actor(address: str, n: int, elements: int, results) -> None:
    """Put ``n`` steps of ``elements`` int64 full of their seq from one array, refilled as
    soon as ``put`` returns: the learner must have read each step by then."""
    from rlink_ucx import Actor

    x = np.empty(elements, dtype=np.int64)
    with Actor(address, transport="shm", actor_id=1) as a:
        for seq in range(n):
            x.fill(seq)
            a.put({"x": x})
        x.fill(-1)
        a.flush(60)
        results.put(a._conn.sender.direct_frames)


def big_frame_actor(address: str, actor: int, transport: str = "tcp", elements: int = 1 << 17) -> None:
    """Send steps of ``elements`` int64 (1 MiB by default), each full of its seq, forever:
    killed mid-frame by the test."""
    from rlink_ucx import Actor

    with Actor(address, transport=transport, actor_id=actor) as a:
        seq = 0
        while True:
            a.put({"x": np.full(elements, seq, dtype=np.int64)})
            seq += 1


def pressing_actor(address: str, actor: int, seconds: float, results, put_timeout: float = 1.0,
                   transport: str = "tcp") -> None:  # fmt: skip
    """Put as fast as possible for ``seconds``; count Backpressure instead of dying of it."""
    from rlink_ucx import Actor, Backpressure, Config

    config = Config(put_timeout=put_timeout, reconnect_timeout=30)
    backpressure = 0
    with Actor(address, transport=transport, actor_id=actor, config=config) as a:
        deadline = time.monotonic() + seconds
        seq = 0
        while time.monotonic() < deadline:
            try:
                a.put_many({"x": np.arange(seq, seq + 256, dtype=np.int64)})
                seq += 256
            except Backpressure:
                backpressure += 1
        stats = a.stats()
        try:
            a.flush(30)
        except Exception:  # noqa: BLE001 - reported below
            pass
        results.put({"actor_id": actor, "backpressure": backpressure, "put": seq, **a.stats(), "before_flush": stats})


def proxied_actor(address: str, n: int, results, transport: str = "tcp", token: str | None = None) -> None:
    """Stream x = seq in small steps (coalesced, kept for resending) through a fault proxy."""
    from rlink_ucx import Actor, Config

    config = Config(reconnect_timeout=60, heartbeat_interval=0.2, heartbeat_timeout=1.5, frame_timeout=2,
                    frame_bytes=64 << 10)  # fmt: skip
    with Actor(address, token=token, transport=transport, actor_id=3, config=config) as a:
        for start in range(0, n, 100):
            a.put_many({"x": np.arange(start, start + 100, dtype=np.int64)})
            time.sleep(0.005)  # about 2 s of streaming: the faults land mid-stream
        a.flush(60)
        results.put(a.stats())


def netns_learner(address: str, token: str, n: int, progress_path: str, result_path: str) -> None:
    """A learner on a non-loopback address (another network namespace): collect ``n`` steps.
    ``progress_path`` holds the steps received so far (0 once it listens); ``progress_path``
    + ".lost" appears once it has found an actor lost."""
    import json
    import os

    from rlink_ucx import Config, Learner, RLinkDataset
    from rlink_ucx import TimeoutError as RLinkTimeout

    config = Config(heartbeat_interval=0.2, heartbeat_timeout=1.5)
    seqs: list[int] = []
    with Learner(address, token=token, transport="tcp", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=100)
        with open(progress_path, "w") as f:
            f.write("0")
        deadline = time.monotonic() + 90
        while len(seqs) < n and time.monotonic() < deadline:
            try:
                seqs += dataset.fetch(timeout=0.5).seq.tolist()
            except RLinkTimeout:
                pass
            with open(progress_path, "w") as f:
                f.write(str(len(seqs)))
            if learner.stats()["lost_actors"] and not os.path.exists(progress_path + ".lost"):
                open(progress_path + ".lost", "w").close()
        while learner.stats()["connected_actors"] and time.monotonic() < deadline:
            time.sleep(0.05)  # stay until the actor has its last acknowledgement and says goodbye
        stats = learner.stats()
    with open(result_path, "w") as f:
        json.dump({"seqs": seqs, "total": stats["total"], "ended": stats["ended_actors"],
                   "address": stats["address"]}, f)  # fmt: skip


def netns_actor(address: str, token: str, n: int, result_path: str) -> None:
    import json

    from rlink_ucx import Actor, Config

    config = Config(heartbeat_interval=0.2, heartbeat_timeout=1.5, reconnect_timeout=60, frame_bytes=32 << 10)
    with Actor(address, token=token, transport="tcp", actor_id=4, config=config) as a:
        for start in range(0, n, 100):
            a.put_many({"x": np.arange(start, start + 100, dtype=np.int64)})
            time.sleep(0.005)
        a.flush(60)
        stats = a.stats()
    with open(result_path, "w") as f:
        json.dump(stats, f)


def netns_congestion_learner(address: str, token: str, congestion: str, result_path: str) -> None:
    """Take 1,000 steps from one tcp actor in another network namespace, with
    ``Config(tcp_congestion=congestion)``; record the congestion control of its data connection.
    ``result_path`` + ".listening" appears once it listens."""
    import json

    from rlink_ucx import Config, Learner, RLinkDataset
    from rlink_ucx.transport.sockopts import congestion_of

    with Learner(address, token=token, transport="tcp", config=Config(tcp_congestion=congestion)) as learner:
        open(result_path + ".listening", "w").close()
        RLinkDataset(learner, batch_size=1000).fetch(timeout=60)
        (session,) = learner._server.sessions.values()  # the actor stays until it sees the file below
        result = {"congestion": congestion_of(session.receiver.sock)}
        with open(result_path + ".read", "w") as f:
            f.write("done")
        deadline = time.monotonic() + 30
        while learner.stats()["connected_actors"] and time.monotonic() < deadline:
            time.sleep(0.05)  # until the actor has its acknowledgement and says goodbye
    with open(result_path, "w") as f:
        json.dump(result, f)


def netns_congestion_actor(address: str, token: str, congestion: str, result_path: str,
                           learner_result_path: str) -> None:  # fmt: skip
    import json
    import os

    from rlink_ucx import Actor, Config
    from rlink_ucx.transport.sockopts import congestion_of

    with Actor(address, token=token, transport="tcp", config=Config(tcp_congestion=congestion)) as a:
        a.put_many({"x": np.arange(1000, dtype=np.int64)})
        a.flush(30)
        result = {"congestion": congestion_of(a._conn.sender.sock)}
        deadline = time.monotonic() + 30
        while not os.path.exists(learner_result_path + ".read") and time.monotonic() < deadline:
            time.sleep(0.02)  # stay connected until the learner has read its end
    with open(result_path, "w") as f:
        json.dump(result, f)


def small_actor(address: str, transport: str, actor: int, n: int) -> None:
    """Put ``n`` small steps and flush them."""
    from rlink_ucx import Actor

    with Actor(address, transport=transport, actor_id=actor) as a:
        a.put_many({"x": np.zeros((n, 8), np.float32)})
        a.flush(30)


def stall_watching_learner(results) -> None:
    """A learner in a fresh process (ucxx not imported yet) that measures how long its event
    loop stalls while the first ucx actor connects: the slowest ``stats()`` call (it is
    answered on the loop), and whether ucxx got imported."""
    import multiprocessing as mp
    import sys
    import threading

    from rlink_ucx import Learner, RLinkDataset

    with Learner("127.0.0.1:0") as learner:
        dataset = RLinkDataset(learner, batch_size=4)
        slowest, done = [0.0], threading.Event()

        def poll() -> None:
            while not done.is_set():
                started = time.perf_counter()
                learner.stats()
                slowest[0] = max(slowest[0], time.perf_counter() - started)
                time.sleep(0.005)

        poller = threading.Thread(target=poll)
        poller.start()
        actor = mp.get_context("spawn").Process(target=small_actor, args=(learner.address, "ucx", 1, 4))
        actor.start()
        try:
            dataset.fetch(timeout=60)
            actor.join(30)
        finally:
            done.set()
            poller.join()
        stats = learner.stats()
        sessions = stats["actors"] + stats["ended_actors"]
        results.put((slowest[0], "ucxx" in sys.modules, [s["transport"] for s in sessions]))


def seq_flood_actor(address: str, actor: int, transport: str = "tcp") -> None:
    """Put x = seq in chunks of 512 KiB, forever (frames large enough for UCX's rendezvous
    path, which maps the actor's shared memory in the learner): killed by the test."""
    from rlink_ucx import Actor

    with Actor(address, transport=transport, actor_id=actor) as a:
        for start in range(0, 1 << 62, 1 << 16):
            a.put_many({"x": np.arange(start, start + (1 << 16), dtype=np.int64)})


def unmappable_shm_actor(address: str, transport: str, actor: int, n: int, out) -> None:
    """An actor that cannot open the learner's ring (as in another PID namespace): it streams
    over the same data connection instead, or fails to connect when shm was requested."""
    from rlink_ucx import Actor, ConnectError
    from rlink_ucx.transport.shm import channel as shm
    def unreachable(*args, **kwargs):
        raise PermissionError("/proc/<pid>/fd is not ours to open (simulated)")

    shm.ShmRing.open = unreachable
    try:
        with Actor(address, transport=transport, actor_id=actor) as a:
            a.put_many({"x": np.arange(n, dtype=np.int64)})
            a.flush(60)
            out.put((a.stats()["transport"], a.stats()["transport_reason"]))
    except ConnectError as exc:
        out.put(("ConnectError", str(exc)))


def early_actor(address: str, n: int, results, hold: float = 0.0) -> None:
    """Started before its learner: wait for it, put ``n`` steps, stay ``hold`` seconds, close."""
    from rlink_ucx import Actor

    started = time.monotonic()
    with Actor(address, transport="tcp") as a:
        results.put(("connected", time.monotonic() - started))
        a.put_many({"x": np.arange(n, dtype=np.int64)})
        a.flush(30)
        time.sleep(hold)
    results.put(("done", n))


def putting_until_closed(address: str, results) -> None:
    """Put steps until the learner finishes; report the error and how long it took to come."""
    from rlink_ucx import Actor, RLinkError

    with Actor(address, transport="tcp") as a:
        results.put(("connected", a.actor_id))
        closed_at = None
        try:
            while True:
                a.put({"x": 1.0})
                if closed_at is None and a.stats()["connected"] is False:
                    closed_at = time.monotonic()
                time.sleep(0.001)
        except RLinkError as exc:
            results.put((type(exc).__name__, str(exc), time.monotonic()))


def storm_actors(address: str, first_id: int, count: int, steps: int, config_kwargs: dict, results) -> None:
    """``count`` actors in threads of one process, all connecting at once; each puts ``steps``
    steps whose values encode (actor, seq), then reports ("ok", id) or (error type, message)."""
    import threading

    from rlink_ucx import Actor, Config, RLinkError

    config = Config(**config_kwargs)
    go = threading.Barrier(count)

    def one(actor_id: int) -> None:
        go.wait()
        try:
            with Actor(address, transport="tcp", actor_id=actor_id, config=config) as a:
                a.put_many({"x": actor_id * 1_000_000 + np.arange(steps, dtype=np.int64)})
                a.flush(60)
            results.put(("ok", actor_id))
        except RLinkError as exc:
            results.put((type(exc).__name__, str(exc)))

    threads = [threading.Thread(target=one, args=(first_id + i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def many_actors_one_process(address: str, count: int, results) -> None:
    """``count`` Actor objects in one process (half tcp, half shm): report the threads they
    add, how often an idle one's linger timer fires (after its first step, which may find no
    credit yet, and after a second step, which leaves at once), and put from every one of
    them, closing half of them half way (the others must keep working on the shared I/O loop)."""
    import threading

    from rlink_ucx import Actor

    base = threading.active_count()
    actors = [Actor(address, transport="tcp" if i % 2 else "shm", actor_id=100 + i) for i in range(count)]
    threads = threading.active_count() - base
    ticks = [0]
    first = actors[0]._writer
    real_tick = first.linger_tick

    def counted_tick() -> None:
        ticks[0] += 1
        real_tick()

    first.linger_tick = counted_tick  # looked up when the timer is armed, at the first step
    for i, a in enumerate(actors):
        a.put({"x": np.int64(a.actor_id * 1000)})  # one step (and the schema)
    time.sleep(0.5)  # a step that found no credit yet leaves after frame_linger; then the timers stop
    ticks_after_step = ticks[0]
    for a in actors:
        a.put({"x": np.int64(a.actor_id * 1000 + 500)})  # the I/O side is idle: sent at once, no timer
    time.sleep(0.5)
    ticks_after_second = ticks[0] - ticks_after_step
    time.sleep(1.0)
    idle_ticks = ticks[0] - ticks_after_step - ticks_after_second
    for a in actors[: count // 2]:
        a.close()
    for a in actors[count // 2 :]:
        a.put_many({"x": np.arange(1, 11, dtype=np.int64) + a.actor_id * 1000})
        a.flush(30)
    for a in actors[count // 2 :]:
        a.close()
    results.put({"threads": threads, "ticks_after_step": ticks_after_step, "ticks_after_second": ticks_after_second,
                 "idle_ticks": idle_ticks, "threads_after_close": threading.active_count() - base})  # fmt: skip

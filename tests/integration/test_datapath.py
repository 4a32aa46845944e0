"""End to end: real learner and actor processes over real sockets / real UCX on loopback."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import time
from typing import Any

import numpy as np
import pytest

import rlink_ucx
from rlink_ucx import Actor, AuthError, Learner, RLinkDataset, SchemaMismatch
from rlink_ucx.wire.frame import FRAME_HEADER
from rlink_ucx.wire.messages import PROTOCOL_VERSION
from tests.conftest import TRANSPORTS, shm_possible
from tests.integration.procs import (
    encoded_steps,
    int_actor,
    large_field_actor,
    large_field_steps,
    lingering_actor,
    steady_actor,
    stream_actor,
    unmappable_shm_actor,
    version_of,
)
from tests.waiting import wait_until

SPAWN = mp.get_context("spawn")


def join_all(procs, timeout=60):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


def stream_and_collect(transport: str, target: Any, n_actors: int, n_steps: int, batch_size: int,
                       fields: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict]:  # fmt: skip
    """Run ``n_actors`` processes of ``target(address, transport, actor_id, n_steps)`` against a
    learner and fetch every step: ``fields`` and each step's actor, seq and version, in the order
    fetched, and the learner's stats at the end."""
    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=batch_size)
        procs = [SPAWN.Process(target=target, args=(learner.address, transport, a + 1, n_steps))
                 for a in range(n_actors)]  # fmt: skip
        for p in procs:
            p.start()
        got: dict[str, list] = {name: [] for name in (*fields, "actor", "seq", "version")}
        for _ in range(n_actors * n_steps // batch_size):
            batch = dataset.fetch(timeout=60)
            for name in fields:
                got[name].append(batch[name].numpy().copy())
            got["actor"].append(batch.actor_id.numpy().copy())
            got["seq"].append(batch.seq.numpy().copy())
            got["version"].append(batch.version.numpy().copy())
            assert (batch.staleness == learner.version - batch.version).all()
        assert join_all(procs) == [0] * n_actors
        stats = learner.stats()
    return {k: np.concatenate(v) for k, v in got.items()}, stats


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_four_actors_every_step_exactly_once_bit_exact(transport):
    n_actors, n_steps, fields = 4, 10_000, ("obs", "action", "reward", "done")
    cat, stats = stream_and_collect(transport, stream_actor, n_actors, n_steps, 500, fields)
    assert len(cat["seq"]) == n_actors * n_steps
    for a in range(1, n_actors + 1):
        mine = cat["actor"] == a
        order = cat["seq"][mine]
        assert order.tolist() == list(range(n_steps)), f"actor {a}: steps missing, duplicated or reordered"
        expected = encoded_steps(a, n_steps)
        for name in ("obs", "action", "reward", "done"):
            assert cat[name][mine].tobytes() == np.ascontiguousarray(expected[name]).tobytes(), name
        assert cat["version"][mine].tolist() == [version_of(s) for s in range(n_steps)]
    assert stats["total"]["steps"] == n_actors * n_steps
    assert {a["transport"] for a in stats["actors"] + stats["ended_actors"]} == {transport}
    if transport == "shm":
        # The learner mapped each actor process's frame buffers (so frames were read in place)...
        assert all("read in place" in a["transport_reason"] for a in stats["actors"] + stats["ended_actors"])
        # ...and each ended session unmapped them and its ring, and closed their descriptors.
        assert wait_until(lambda: shm_rings_held() == (0, 0), 10), shm_rings_held()


def shm_rings_held() -> tuple[int, int]:
    """This process's open descriptors of, and mappings of, shm-plane rings."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(("/memfd:rlink-shm", "/memfd:rlink-arena"))
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        return fds, sum("/memfd:rlink-shm" in line or "/memfd:rlink-arena" in line for line in maps)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not shm_possible(), reason="no memfd (not Linux)")
def test_a_same_host_actor_that_cannot_map_the_shared_ring_streams_over_tcp_instead():
    with Learner("127.0.0.1:0") as learner:  # auto: shm for actors on this host
        dataset = RLinkDataset(learner, batch_size=1000)
        out = SPAWN.Queue()
        proc = SPAWN.Process(target=unmappable_shm_actor, args=(learner.address, "auto", 1, 5000, out))
        proc.start()
        got = np.concatenate([dataset.fetch(timeout=60)["x"].numpy() for _ in range(5)])
        transport, reason = out.get(timeout=60)
        assert join_all([proc]) == [0]
        actors = learner.stats()["actors"] + learner.stats()["ended_actors"]
        assert shm_rings_held() == (0, 0)  # the unused ring was closed when the actor attached
    assert got.tolist() == list(range(5000))
    assert transport == "tcp" and "cannot be mapped" in reason
    assert [a["transport"] for a in actors] == ["tcp"] and "could not map" in actors[0]["transport_reason"]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not shm_possible(), reason="no memfd (not Linux)")
def test_an_shm_actor_that_keeps_no_frames_for_resending_sends_them_through_the_ring(monkeypatch):
    # Without resending, a frame buffer is refilled as soon as it is sent: the learner must not
    # read it in place, so the actor offers no arena and copies every frame into the ring.
    monkeypatch.setenv("RLINK_RESEND_BUFFER_BYTES", "0")
    with Learner("127.0.0.1:0", transport="shm") as learner:
        dataset = RLinkDataset(learner, batch_size=500)
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=steady_actor, args=(learner.address, 1, 20_000, 500, results),
                             kwargs={"transport": "shm"})  # fmt: skip
        proc.start()
        got = np.concatenate([dataset.fetch(timeout=60)["x"].numpy() for _ in range(40)])
        assert results.get(timeout=60)["steps_sent"] == 20_000
        assert join_all([proc]) == [0]
        actors = learner.stats()["actors"] + learner.stats()["ended_actors"]
    assert got.tolist() == list(range(20_000))
    assert [a["transport"] for a in actors] == ["shm"] and "read in place" not in actors[0]["transport_reason"]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not shm_possible(), reason="no memfd (not Linux)")
def test_an_actor_that_requested_shm_and_cannot_map_the_ring_gets_a_connect_error():
    with Learner("127.0.0.1:0") as learner:
        out = SPAWN.Queue()
        proc = SPAWN.Process(target=unmappable_shm_actor, args=(learner.address, "shm", 1, 10, out))
        proc.start()
        kind, text = out.get(timeout=50)
        assert join_all([proc]) == [0]
        # The session that never attached took its ring with it (the learner is still up).
        assert wait_until(lambda: shm_rings_held() == (0, 0), 10), shm_rings_held()
    assert kind == "ConnectError" and "shm requested" in text and "simulated" in text


@pytest.mark.timeout(30)
def test_fetch_times_out_on_an_idle_learner():
    with Learner("127.0.0.1:0") as learner:
        dataset = RLinkDataset(learner, batch_size=4)
        t0 = time.monotonic()
        with pytest.raises(rlink_ucx.TimeoutError):
            dataset.fetch(timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        with Actor(learner.address, transport="tcp") as actor:
            actor.put({"x": np.zeros(2, np.float32)})
            actor.flush(10)
            with pytest.raises(TimeoutError):  # the rlink error is also a builtin TimeoutError
                dataset.fetch(timeout=0.3)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_steps_with_several_large_fields_arrive_bit_exact(transport):
    # Over ucx each of the two large fields is a message of its own (eager or rendezvous by
    # size), received into the ring in turn once its length is checked; the small one rides in
    # the header's message.
    n_actors, n_steps = 2, 600
    cat, stats = stream_and_collect(transport, large_field_actor, n_actors, n_steps, 100, ("obs", "mask", "reward"))
    for a in range(1, n_actors + 1):
        mine = cat["actor"] == a
        assert cat["seq"][mine].tolist() == list(range(n_steps)), f"actor {a}: steps missing, duplicated or reordered"
        expected = large_field_steps(a, n_steps)
        for name in ("obs", "mask", "reward"):
            assert cat[name][mine].tobytes() == expected[name].tobytes(), name
    assert {a["transport"] for a in stats["actors"] + stats["ended_actors"]} == {transport}
    assert all(a["protocol_errors"] == 0 for a in stats["actors"] + stats["ended_actors"])


@pytest.mark.timeout(60)
def test_a_field_of_zero_size_arrives_as_an_empty_tensor_of_its_dtype():
    # torch cannot view zero bytes as float32: every fetch used to fail, losing the steps.
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=10)
        with Actor(learner.address, transport="tcp") as actor:
            actor.put_many({"empty": np.zeros((10, 3, 0), np.float32), "x": np.arange(10)})
            actor.flush(10)
            batch = dataset.fetch(timeout=10)
    assert batch["empty"].shape == (10, 3, 0) and str(batch["empty"].dtype) == "torch.float32"
    assert batch["x"].tolist() == list(range(10))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_twice_is_fine(transport):
    learner = Learner("127.0.0.1:0", transport=transport)
    actor = Actor(learner.address, transport=transport)
    actor.put({"x": np.arange(3)})
    actor.close()
    actor.close()
    learner.close()
    learner.close()
    with pytest.raises(rlink_ucx.Closed):
        actor.put({"x": np.arange(3)})
    assert learner.closed


@pytest.mark.timeout(30)
def test_tokens_mutual_auth():
    secret = "s3cret-s3cret-s3cret"
    with Learner("127.0.0.1:0", token=secret) as learner:
        with pytest.raises(AuthError, match="did not match|refused"):
            Actor(learner.address, token="wrong-wrong-wrong-wrong")
        with pytest.raises(AuthError, match="requires a token"):  # a given token is never written for actors
            Actor(learner.address)
        with Actor(learner.address, token=secret) as ok:
            ok.put({"x": np.arange(3)})
            ok.flush(10)
        stats = learner.stats()
        assert stats["auth_failures"] >= 1
        assert secret not in repr(stats)
    with Learner("127.0.0.1:0", insecure=True) as open_learner:  # no proof from the learner: refused
        with pytest.raises(AuthError, match="does not authenticate"):
            Actor(open_learner.address, token=secret)
        with Actor(open_learner.address, insecure=True) as knowingly:  # unless asked for
            knowingly.put({"x": np.arange(3)})
            knowingly.flush(10)


@pytest.mark.timeout(60)
def test_an_insecure_actor_ignores_a_token_file_left_on_its_learners_port(tmp_path):
    # A learner killed earlier left its generated token for this port; the insecure learner now
    # there has none. The actor used to derive its data connection's proof from that stale
    # file, which the learner refused, and retried until connect_timeout (a flaky test here).
    token_dir = tmp_path / "tokens"
    token_dir.mkdir(mode=0o700)
    config = rlink_ucx.Config(token_dir=str(token_dir), connect_timeout=15)
    with Learner("127.0.0.1:0", insecure=True, config=config) as learner:
        stale = token_dir / f"{learner.port}.token"
        stale.write_text("left-by-a-learner-killed-on-this-port")
        stale.chmod(0o600)
        dataset = RLinkDataset(learner, batch_size=3)
        with Actor(learner.address, insecure=True, config=config) as actor:
            actor.put_many({"x": np.arange(3)})
            actor.flush(10)
        assert dataset.fetch(timeout=10)["x"].tolist() == [0, 1, 2]
        assert learner.stats()["auth_failures"] == 0


@pytest.mark.timeout(30)
def test_non_loopback_bind_without_token_refuses():
    with pytest.raises(rlink_ucx.ConfigError, match="without a token"):
        Learner("0.0.0.0:0")


@pytest.mark.timeout(30)
def test_schema_mismatch_names_field_and_both_specs():
    with Learner("127.0.0.1:0") as learner:
        dataset = RLinkDataset(learner, batch_size=2)
        with Actor(learner.address) as actor:
            actor.put({"obs": np.zeros(4, np.float32), "done": False})
            with pytest.raises(SchemaMismatch, match=r"'obs'.*float32\[4\].*bool\[4\]"):
                actor.put({"obs": np.zeros(4, bool), "done": False})  # a change of kind
            with pytest.raises(SchemaMismatch, match=r"'obs'.*float32\[4\].*float32\[5\]"):
                actor.put_many({"obs": np.zeros((3, 5), np.float32), "done": np.zeros(3, bool)})
            with pytest.raises(SchemaMismatch, match="extra"):
                actor.put({"obs": np.zeros(4, np.float32), "done": False, "extra": 1})
            with pytest.raises(SchemaMismatch, match="'done'.*missing"):
                actor.put({"obs": np.zeros(4, np.float32)})
            actor.put({"obs": np.ones(4, np.float32), "done": True})
            actor.flush(10)
        batch = dataset.fetch(timeout=10)  # nothing accepted before the errors was lost
        assert batch["obs"].tolist() == [[0.0] * 4, [1.0] * 4] and batch["done"].tolist() == [False, True]
        with Actor(learner.address) as other:  # a second actor with another schema is rejected
            with pytest.raises(SchemaMismatch, match="learner rejected.*obs"):
                other.put({"obs": np.zeros(3, np.int32), "done": False})


@pytest.mark.timeout(60)
def test_put_takes_every_kind_of_value_and_a_bad_one_puts_nothing():
    import torch

    config = rlink_ucx.Config(frame_bytes=5 * 24)  # 5 steps per frame: puts cross frame boundaries
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=20)
        with Actor(learner.address, transport="tcp", config=config) as actor:
            actor.put({"obs": np.zeros(2, np.float32), "action": 0, "r": 0.0, "done": False})
            kinds = [
                lambda i: {"obs": np.full(2, i, np.float32), "action": i, "r": i / 2, "done": i % 2 == 1},
                lambda i: {"obs": np.full(2, i, np.float64), "action": np.int64(i), "r": np.float32(i / 2),
                           "done": np.bool_(i % 2)},  # float64 obs: cast to float32 (same kind)
                lambda i: {"obs": torch.full((2,), float(i)), "action": torch.tensor(i), "r": torch.tensor(i / 2),
                           "done": torch.tensor(i % 2 == 1)},
                lambda i: {"obs": np.full(4, i, np.float32)[::2], "action": i, "r": i / 2, "done": bool(i % 2)},
                lambda i: {"done": i % 2 == 1, "r": i / 2, "obs": np.full(2, i, np.float32), "action": i},
            ]  # fmt: skip
            expected = [0]
            for i in range(1, 40):  # 40 steps in all, versions changing in the middle of frames
                step = kinds[i % len(kinds)](i)
                with pytest.raises(SchemaMismatch):
                    actor.put({**step, "action": 1.5})  # a float for an int field
                with pytest.raises(SchemaMismatch):
                    actor.put({**step, "obs": np.zeros(3, np.float32)})
                with pytest.raises(SchemaMismatch, match="'action'.*range"):
                    actor.put({**step, "action": 2**70})  # fails halfway through the step's fields
                with pytest.raises(SchemaMismatch, match="'obs'.*bool"):
                    actor.put({**step, "obs": np.ones(2, bool)})  # a change of kind is never cast
                actor.put(step, version=i // 7)
                expected.append(i)
            actor.flush(10)
        seen = []
        for _ in range(2):
            b = dataset.fetch(timeout=10)
            assert b.seq.tolist() == list(range(len(seen), len(seen) + 20)), "a rejected put took a seq"
            seen += b["action"].tolist()
            assert b["obs"][:, 0].tolist() == b["action"].float().tolist()
            assert b["r"].tolist() == [a / 2 for a in b["action"].tolist()]
            assert b["done"].tolist() == [a % 2 == 1 for a in b["action"].tolist()]
            assert b.version.tolist() == [a // 7 for a in b["action"].tolist()]
        assert seen == expected


def _raw_connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


@pytest.mark.timeout(60)
def test_garbage_connections_do_not_disturb_a_streaming_actor():
    # A truncated message is only dropped when the handshake times out: keep that short.
    with Learner("127.0.0.1:0", transport="tcp", config=rlink_ucx.Config(handshake_timeout=1.0)) as learner:
        dataset = RLinkDataset(learner, batch_size=100)
        proc = SPAWN.Process(target=stream_actor, args=(learner.address, "tcp", 1, 3000))
        proc.start()
        attacks = [
            b"GET / HTTP/1.1\r\n\r\n",
            struct.pack("<I", 2**31) + b"x" * 16,  # absurd length prefix
            struct.pack("<I", 400) + b"\xff" * 400,  # malformed msgpack
            b"\x00" * 3,  # truncated
        ]
        for raw in attacks:
            t0 = time.monotonic()
            s = _raw_connect(learner.address)
            s.recv(512)  # the challenge
            s.sendall(raw)
            s.settimeout(5)
            try:
                while s.recv(4096):  # the learner must close it
                    pass
            except ConnectionResetError:
                pass
            assert time.monotonic() - t0 < 3, "the learner must drop a bad connection within the handshake timeout"
            s.close()
        seqs = []
        for _ in range(30):
            seqs += dataset.fetch(timeout=30).seq.tolist()
        assert seqs == list(range(3000))
        assert join_all([proc]) == [0]
        assert learner.stats()["connected_actors"] == 0


@pytest.mark.timeout(30)
def test_a_kept_batch_is_never_overwritten_by_later_fetches():
    with Learner("127.0.0.1:0") as learner:
        dataset = RLinkDataset(learner, batch_size=4)
        with Actor(learner.address) as actor:
            actor.put_many({"x": np.arange(64, dtype=np.int64)})
            actor.flush(10)
            kept = dataset.fetch(timeout=10)
            view = kept["x"][1:]  # a view keeps the staging buffer alive too
            later = [dataset.fetch(timeout=10)["x"].tolist() for _ in range(10)]
        assert kept["x"].tolist() == [0, 1, 2, 3] and view.tolist() == [1, 2, 3]
        assert later[-1] == [40, 41, 42, 43]



@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 64,  # bad magic
        FRAME_HEADER.pack(b"RLNK", PROTOCOL_VERSION, 0, 99, 1, 1, 0, 0, 0, 8, 0),  # unknown schema id
        FRAME_HEADER.pack(b"RLNK", PROTOCOL_VERSION, 0, 1, 1, 1, 0, 10, 0, 2**40, 0),  # oversized claim
    ],
    ids=["bad-magic", "unknown-schema", "oversized"],
)
def test_a_bad_data_frame_drops_only_that_actor_and_loses_nothing_accepted(garbage):
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=10)
        bad = Actor(learner.address, transport="tcp", actor_id=1)
        bad.put_many({"x": np.arange(10, dtype=np.int64)})
        bad.flush(10)  # accepted: must survive what follows
        good = SPAWN.Process(target=int_actor, args=(learner.address, 2, 2000))
        good.start()
        bad._conn.sender.sock.sendall(garbage)  # behind the library's back, on its data socket
        deadline = time.monotonic() + 10
        while not any(a["actor_id"] == 1 for a in learner.stats()["ended_actors"]):
            assert time.monotonic() < deadline, "the learner did not drop the misbehaving actor"
            time.sleep(0.05)
        first = dataset.fetch(timeout=10)
        assert first["x"].tolist() == list(range(10)) and first.actor_id.tolist() == [1] * 10
        got = [dataset.fetch(timeout=30) for _ in range(200)]
        assert [s for b in got for s in b.seq.tolist()] == list(range(2000))
        assert [x for b in got for x in b["x"].tolist()] == list(range(2000))
        assert join_all([good]) == [0]
        ended = next(a for a in learner.stats()["ended_actors"] if a["actor_id"] == 1)
        assert ended["state"] == "lost" and ended["protocol_errors"] == 1
        # The dropped actor reconnects (same incarnation) and its stream resumes where the
        # learner stopped: nothing it sent before is delivered twice, nothing after is lost.
        bad.put_many({"x": np.arange(10, 20, dtype=np.int64)})
        bad.flush(15)
        again = dataset.fetch(timeout=10)
        assert again["x"].tolist() == list(range(10, 20)) and again.seq.tolist() == list(range(10, 20))
        assert bad.stats()["reconnects"] == 1 and bad.stats()["steps_lost"] == 0
        bad.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frames_leave_in_order_when_linger_races_full_frames(transport):
    n = 20_000
    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=20)
        proc = SPAWN.Process(target=lingering_actor, args=(learner.address, transport, n))
        proc.start()
        total = n + n // 1000
        seqs, values = [], []
        for _ in range(total // 20):
            batch = dataset.fetch(timeout=30)
            seqs += batch.seq.tolist()
            values += batch["x"].tolist()
        assert join_all([proc]) == [0]
        assert learner.stats()["lost_actors"] == 0
    assert seqs == list(range(total))
    assert [v for v in values if v >= 0] == list(range(n)) and values.count(-1) == n // 1000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", [t for t in ("tcp", "shm") if t != "shm" or shm_possible()])
def test_the_first_put_makes_one_frame_buffer_and_a_busy_actor_makes_the_rest(transport):
    # A storm of first puts used to carve (and populate) frame_buffers x frame_bytes per actor:
    # 4 MiB each for a step of 8 bytes. A slow actor needs one; a busy one gets the others
    # when a put finds none free, up to frame_buffers.
    config = rlink_ucx.Config(frame_bytes=64 * 8, put_timeout=5)
    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=1000)
        with Actor(learner.address, transport=transport, config=config) as actor:
            outbox = actor._conn.outbox
            actor.put({"x": np.int64(0)})
            assert outbox.buffers == 1
            for i in range(1, 1000):  # 64 steps a frame: faster than frames leave one by one
                actor.put({"x": np.int64(i)})
            actor.flush(10)
            assert 1 < outbox.buffers <= actor._writer._max_buffers  # (frames kept for resending hold more)
            assert dataset.fetch(timeout=10)["x"].tolist() == list(range(1000))


@pytest.mark.timeout(60)
def test_full_frames_then_flush_never_run_out_of_frame_buffers_without_resending():
    # resend off: a frame sent from the caller's thread is reused at once as the current frame,
    # and a flush right after must give that empty buffer back (4 rounds used to exhaust them).
    config = rlink_ucx.Config(resend_buffer_bytes=0, frame_bytes=10 * 8, put_timeout=3)
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=10)
        with Actor(learner.address, transport="tcp", config=config) as actor:
            for r in range(12):
                for i in range(10):
                    actor.put({"x": np.int64(r * 10 + i)})
                actor.flush(10)
                assert dataset.fetch(timeout=10)["x"].tolist() == list(range(r * 10, r * 10 + 10))

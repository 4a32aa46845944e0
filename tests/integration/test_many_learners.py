"""Many learner ranks, one stream: learner ranks under torchrun (or started as torchrun starts
them) share actors that know only rank 0's address.

Every rank runs tests/integration/ranks_job.py and every actor tests/integration/ranks_actor.py,
each a real process over real sockets. Checked: every step reaches exactly one rank exactly
once, actors are balanced over the ranks, every actor gets every version the ranks publish; a
non-zero rank killed mid-stream (its actors move on, losing and resending what the documented
contract says), and rank 0 killed (the other ranks' actors carry on; its own wait, then fail).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.test_netns import two_hosts  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "integration" / "ranks_job.py"
ACTOR = ROOT / "tests" / "integration" / "ranks_actor.py"
RING_STEPS = 64 * 1024 * 1024 // 16  # the default ring holds at most this many 16-byte steps


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RLINK_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "SLURM_", "TORCHELASTIC"))}  # fmt: skip
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["RLINK_LOG"] = "info"  # in each process's output, kept in the test's folder
    return {**env, **extra}


def torchrun(world: int, out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(JOB),
           "--out", str(out), *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=open(out / "job.log", "w"), stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def ranks_by_hand(world: int, out: Path, *args: str, prefix: tuple[str, ...] = (), per_rank: list[dict] | None = None,
                  **env: str) -> list[subprocess.Popen]:  # fmt: skip
    """The ranks started as torchrun starts its workers (without its agent, which would end the
    whole job when one rank dies)."""
    master = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env}
    return [subprocess.Popen([*prefix, sys.executable, str(JOB), "--out", str(out), *args], cwd=ROOT,
                             env=clean_env(RANK=str(r), LOCAL_RANK=str(r), **master, **(per_rank or [{}] * world)[r]),
                             stdout=open(out / f"rank{r}.log", "w"), stderr=subprocess.STDOUT, text=True)
            for r in range(world)]  # fmt: skip


def actors(out: Path, count: int, steps: int, versions: int = 0, prefix: tuple[str, ...] = (), pace: float = 0.002,
           first: int = 0, extra: tuple[str, ...] = (), **env: str) -> list[subprocess.Popen]:  # fmt: skip
    procs = []
    for i in range(first, first + count):
        given = ["--actor-id", str(100 + i)] if i % 2 else []  # half given ids, half given one by rank 0
        procs.append(subprocess.Popen([*prefix, sys.executable, str(ACTOR), "--out", str(out), "--index", str(i),
                                       "--steps", str(steps), "--versions", str(versions), "--pace", str(pace), *given, *extra], cwd=ROOT,
                                      env=clean_env(**env), stdout=open(out / f"actor{i}.log", "w"),
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    return procs


def logs(out: Path) -> str:
    """The tails of every process's output (RLINK_LOG=info), for a failing assertion."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(out.glob("*.log")))


def wait_files(out: Path, names: list[str], timeout: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not all((out / n).exists() for n in names):
        dead = [p for p in procs if p.poll() not in (None, 0)]
        assert not dead, f"{dead[0].args} exited {dead[0].returncode}: {logs(out)}"
        assert time.monotonic() < deadline, f"no {[n for n in names if not (out / n).exists()]} in {timeout}s"
        time.sleep(0.05)


def finish(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}"


def deliveries(out: Path, rank: int) -> dict[int, list[int]]:
    """Actor id -> the seqs rank ``rank`` fetched, in order; each step's value is its seq."""
    got: dict[int, list[int]] = collections.defaultdict(list)
    path = out / f"rank{rank}.steps"
    for line in path.read_text().splitlines() if path.exists() else []:
        actor, seq, value = map(int, line.split())
        assert value == seq, line
        got[actor].append(seq)
    return got


def results(out: Path, count: int) -> list[dict]:
    return [json.loads((out / f"actor{i}.json").read_text()) for i in range(count)]


def check_exactly_once(out: Path, world: int, n_actors: int, steps: int) -> dict[int, int]:
    """Every step of every actor at exactly one rank, exactly once; returns actor id -> rank."""
    home: dict[int, int] = {}
    for rank in range(world):
        for actor, seqs in deliveries(out, rank).items():
            assert actor not in home, f"actor {actor} reached ranks {home[actor]} and {rank}"
            home[actor] = rank
            assert sorted(seqs) == list(range(steps)), (rank, actor, len(seqs))
    assert len(home) == n_actors, home
    return home


def run_job(tmp_path: Path, world: int, n_actors: int, steps: int = 400, versions: int = 3) -> None:
    job = torchrun(world, tmp_path, "--versions", str(versions))
    acts: list[subprocess.Popen] = []
    try:
        wait_files(tmp_path, ["address"], 90, [job])
        acts = actors(tmp_path, n_actors, steps, versions)
        wait_files(tmp_path, [f"actor{i}.connected" for i in range(n_actors)], 90, [job, *acts])
        (tmp_path / "go").touch()  # every actor streams and is subscribed: the ranks publish
        finish(acts, 120)
        finish([job], 60)
    finally:
        for p in [job, *acts]:
            p.kill()
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    home = check_exactly_once(tmp_path, world, n_actors, steps)
    per_rank = collections.Counter(home.values())
    assert max(per_rank.values()) - min(per_rank.values()) <= 1 and len(per_rank) == world, per_rank
    address = (tmp_path / "address").read_text()
    for rank, summary in enumerate(summaries):
        assert summary["rank"] == rank and summary["world_size"] == world
        assert summary["published"] == list(range(1, versions + 1)) and summary["version"] == versions
        assert sorted(summary["actors"]) == sorted(a for a, r in home.items() if r == rank)
        assert (summary["address"] == address) == (rank == 0)
    assert {int(r): v["actors"] for r, v in summaries[0]["ranks"].items()} == dict(per_rank)
    for got in results(tmp_path, n_actors):
        assert got["error"] is None, got
        assert got["seen"] == sorted(set(got["seen"])) and got["seen"][-1] == versions and got["w"] == versions, got
        w = got["weights"]
        assert w["shared_reads"] + w["streamed"] == versions, got  # each version reached it once
    for got in results(tmp_path, n_actors):  # each actor says which rank serves it
        assert got["learner_rank"] == home[got["actor_id"]], got
    ids = [got["actor_id"] for got in results(tmp_path, n_actors)]
    assert len(set(ids)) == n_actors and {100 + i for i in range(1, n_actors, 2)} <= set(ids)


@pytest.mark.timeout(300)
def test_two_ranks_under_torchrun_share_six_actors(tmp_path):
    run_job(tmp_path, world=2, n_actors=6)


@pytest.mark.timeout(300)
def test_three_ranks_under_torchrun_share_eight_actors(tmp_path):
    run_job(tmp_path, world=3, n_actors=8)


@pytest.mark.timeout(300)
def test_a_killed_rank_s_actors_move_to_the_others_as_the_contract_says(tmp_path):
    world, n_actors, steps = 3, 6, 3000
    ranks = ranks_by_hand(world, tmp_path, "--versions", "0")
    acts: list[subprocess.Popen] = []
    try:
        wait_files(tmp_path, ["address"], 90, ranks)
        acts = actors(tmp_path, n_actors, steps, pace=0.003)  # ~9 s of steps
        wait_files(tmp_path, [f"actor{i}.connected" for i in range(n_actors)], 90, [*ranks, *acts])
        deadline = time.monotonic() + 60
        while len(deliveries(tmp_path, 1)) < 2 or min(map(len, deliveries(tmp_path, 1).values())) < 300:
            assert time.monotonic() < deadline, "rank 1 fetched nothing"
            time.sleep(0.05)
        ranks[1].send_signal(signal.SIGKILL)  # mid-stream
        finish(acts, 150)
        finish([ranks[0], ranks[2]], 90)
    finally:
        for p in [*ranks, *acts]:
            p.kill()
    at = [deliveries(tmp_path, r) for r in range(world)]
    moved = set(at[1])
    assert len(moved) == 2, at[1].keys()
    for got in results(tmp_path, n_actors):
        assert got["error"] is None, got  # every actor finished: moved ones on a surviving rank
    for actor in {a for r in (0, 2) for a in at[r]} | moved:
        survivors = [r for r in (0, 2) if actor in at[r]]
        assert len(survivors) == 1, (actor, survivors)  # moved to exactly one surviving rank
        new = at[survivors[0]][actor]
        assert len(new) == len(set(new)), actor  # exactly once per rank (learner lifetime)
        if actor not in moved:
            assert sorted(new) == list(range(steps))
            continue
        # The surviving rank got everything from the actor's oldest unacknowledged step on;
        # below it, rank 1 had acknowledged each step: those it fetched before it died were
        # delivered, the rest died with its buffer (lost), and none of them is resent.
        resumed = min(new)
        assert sorted(new) == list(range(resumed, steps)), actor
        old = set(at[1][actor])
        lost = set(range(resumed)) - old
        assert resumed > 0 and len(lost) <= RING_STEPS, (actor, resumed, len(lost))
        assert old <= set(range(steps)) and len(at[1][actor]) == len(old)


@pytest.mark.timeout(240)
def test_rank_0_killed_other_ranks_keep_their_actors_and_rank_0_s_wait_then_fail(tmp_path):
    world, n_actors, steps = 2, 4, 2500
    ranks = ranks_by_hand(world, tmp_path, "--versions", "0")
    acts: list[subprocess.Popen] = []
    try:
        wait_files(tmp_path, ["address"], 90, ranks)
        acts = actors(tmp_path, n_actors, steps, pace=0.003, RLINK_RECONNECT_TIMEOUT="4")
        wait_files(tmp_path, [f"actor{i}.connected" for i in range(n_actors)], 90, [*ranks, *acts])
        deadline = time.monotonic() + 60
        while len(deliveries(tmp_path, 0)) < 2:
            assert time.monotonic() < deadline, "rank 0 fetched nothing"
            time.sleep(0.05)
        ranks[0].send_signal(signal.SIGKILL)
        finish(acts, 120)
        finish([ranks[1]], 90)
    finally:
        for p in [*ranks, *acts]:
            p.kill()
    at0, at1 = deliveries(tmp_path, 0), deliveries(tmp_path, 1)
    assert len(at0) == 2 and len(at1) == 2, (at0.keys(), at1.keys())
    for actor, seqs in at1.items():  # rank 1's actors never noticed
        assert sorted(seqs) == list(range(steps))
    for got in results(tmp_path, n_actors):
        if got["error"] is None:
            assert got["actor_id"] in at1, got
        else:  # rank 0's: retried its address for reconnect_timeout, then gave up
            assert got["error"].startswith("PeerLost") and "unreachable" in got["error"], got
    assert sum(got["error"] is not None for got in results(tmp_path, n_actors)) == 2


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_two_ranks_on_two_hosts_share_actors_that_know_only_rank_0(two_hosts, tmp_path):  # noqa: F811 - the fixture
    ns_a, ns_b, va = two_hosts
    vb = "vb" + va[2:]
    n_actors, steps, versions = 6, 400, 2
    # Across hosts the ranks are given the rank token (actors are not) and a fixed port.
    common = {"RLINK_TOKEN": "ranks-" + uuid.uuid4().hex, "RLINK_RANK_TOKEN": "rank-token-" + uuid.uuid4().hex,
              "WORLD_SIZE": "2", "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29517"}  # fmt: skip
    ranks = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(JOB), "--out", str(tmp_path), "--address",
                               "0.0.0.0:7447", "--versions", str(versions)], cwd=ROOT,
                              env=clean_env(RANK=str(r), GLOO_SOCKET_IFNAME=dev, **common),
                              stdout=open(tmp_path / f"rank{r}.log", "w"), stderr=subprocess.STDOUT)
             for r, (ns, dev) in enumerate(((ns_a, va), (ns_b, vb)))]  # fmt: skip
    acts: list[subprocess.Popen] = []
    try:
        wait_files(tmp_path, ["address"], 90, ranks)
        token = {"RLINK_TOKEN": common["RLINK_TOKEN"]}
        half = n_actors // 2  # on each host, all told rank 0's address
        acts = [*actors(tmp_path, half, steps, versions, prefix=("ip", "netns", "exec", ns_a), extra=("--host", "10.77.0.1"),
                        **token),
                *actors(tmp_path, half, steps, versions, prefix=("ip", "netns", "exec", ns_b), first=half,
                        extra=("--host", "10.77.0.1"), **token)]  # fmt: skip
        wait_files(tmp_path, [f"actor{i}.connected" for i in range(n_actors)], 90, [*ranks, *acts])
        (tmp_path / "go").touch()
        finish(acts, 120)
        finish(ranks, 60)
    finally:
        for p in [*ranks, *acts]:
            p.kill()
    home = check_exactly_once(tmp_path, 2, n_actors, steps)
    assert collections.Counter(home.values()) == {0: 3, 1: 3}, home
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert summaries[0]["ranks"]["1"]["address"] == "10.77.0.2:" + summaries[1]["address"].rsplit(":", 1)[1]
    assert summaries[1]["address"].startswith("0.0.0.0:")  # all interfaces, advertised as the address toward rank 0
    for got in results(tmp_path, n_actors):
        assert got["error"] is None and got["seen"][-1] == versions and got["w"] == versions, got


@pytest.mark.timeout(240)
def test_each_rank_keeps_and_checkpoints_a_replay_of_its_own_actors(tmp_path):
    world, n_actors, steps = 2, 4, 300
    ranks = ranks_by_hand(world, tmp_path, "--replay", str(tmp_path / "replay"))
    acts: list[subprocess.Popen] = []
    try:
        wait_files(tmp_path, ["address"], 90, ranks)
        acts = actors(tmp_path, n_actors, steps)
        finish(acts, 120)
        finish(ranks, 90)
    finally:
        for p in [*ranks, *acts]:
            p.kill()
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert sorted(p.name for p in (tmp_path / "replay").iterdir()) == ["rank-0", "rank-1"]
    for got in summaries:
        assert len(got["actors"]) == 2 and got["held"] == got["loaded"] == 2 * steps, got
    assert set(summaries[0]["actors"]).isdisjoint(summaries[1]["actors"])


@pytest.mark.timeout(120)
def test_a_rank_with_another_token_stops_every_rank_with_a_config_error(tmp_path):
    tokens = [{"RLINK_TOKEN": "first-" + uuid.uuid4().hex}, {"RLINK_TOKEN": "second-" + uuid.uuid4().hex}]
    ranks = ranks_by_hand(2, tmp_path, per_rank=tokens)
    try:
        for proc in ranks:
            proc.wait(timeout=90)
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [1, 1]
    rank0, rank1 = (tmp_path / "rank0.log").read_text(), (tmp_path / "rank1.log").read_text()
    assert "ConfigError: learner rank 1 holds another token than rank 0" in rank1, rank1[-2000:]
    assert "ConfigError: learner rank 1 of 2 did not start" in rank0, rank0[-2000:]
    assert not (tmp_path / "address").exists() or not (tmp_path / "rank0.json").exists()


"""Weights by broadcast on a trusted network (``Config(weights_fanout="broadcast")``,
``weights/broadcast.py``), with real processes on network namespaces with their own host
names (``rlink_ucx/bench/netns.py``): the learner and each host's streamer form a gloo group
and each version's bytes go by broadcast; keys and Seals come on the control connections and
every actor checks every version bit for bit. A member killed or stopped in the middle never
holds ``publish``: the group is dropped, its host takes the version by stream, and the group is
formed again. Needs root and torch; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from rlink_ucx.bench.fanout_hosts import run
from rlink_ucx.bench.netns import Hosts, available
from tests.integration.test_relays import WEIGHTS_TIMEOUT, Cluster

pytest.importorskip("torch.distributed")
WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}")


@pytest.mark.timeout(420)
def test_eight_hosts_of_four_actors_take_each_version_by_broadcast():
    report = run(8, 4, mb=8, mbit=400, versions=3, modes=("broadcast",))
    mode = report["modes"]["broadcast"]
    print(json.dumps({k: v for k, v in mode.items() if k != "actors"}), report["raw_transfer_seconds"])
    assert mode["all_confirmed"] and mode["every_version_exact"], mode["actors"]
    assert len(mode["actors"]) == 32
    for actor in mode["actors"]:  # every version after the first, each bit-exact
        assert actor["exact"] and actor["versions"][-1] == 4, actor
    # One member per host took the timed versions by broadcast; its 3 peers read its copy.
    cast = sorted(a["weights"]["broadcast"] for a in mode["actors"])
    # (A member stalled past weights_timeout / 6 on a loaded machine takes a version by stream.)
    assert cast.count(0) == 24 and min(cast[-8:]) >= 2 and sum(cast) >= 22, cast
    assert sum(a["weights"]["shared_reads"] for a in mode["actors"]) == 24 * 3
    assert mode["broadcast"]["versions"] >= 3 and mode["broadcast"]["failures"] == 0, mode["broadcast"]


def _group(cluster: Cluster, members: int, timeout: float = 60) -> dict[str, Any]:
    """The learner's broadcast stats, once its group holds ``members`` hosts."""
    deadline = time.monotonic() + timeout
    while (cast := cluster.ask("stats")["weights"]["broadcast"])["members"] != members:
        assert time.monotonic() < deadline, cast
        time.sleep(0.2)
    return cast


@pytest.mark.timeout(420)
def test_a_member_killed_or_stopped_never_holds_publish_and_the_group_forms_again(monkeypatch):
    monkeypatch.setenv("RLINK_WEIGHTS_FANOUT", "broadcast")
    count, per_host, floats = 3, 2, 1 << 20  # 4 MiB a version
    with Hosts(count, None) as hosts:
        cluster = Cluster(hosts, per_host, floats)
        everyone = list(cluster.actors)
        try:
            formed = _group(cluster, count)["formed"]
            assert cluster.ask("publish 2")["confirmed"]
            cluster.wait_all(2, everyone, 10)
            weights = cluster.ask("stats")["weights"]
            assert weights["broadcast"]["versions"] >= 1, weights["broadcast"]

            # SIGKILL host 2's streamer while version 3 goes out: publish returns, every live
            # actor has it, and the group forms again with the host's next streamer.
            killed = cluster.streamer(hosts.names[2], weights)
            cluster.actors[killed].kill()
            started = time.monotonic()
            reply = cluster.ask(f"publish 3 {WEIGHTS_TIMEOUT}")
            assert time.monotonic() - started < WEIGHTS_TIMEOUT + 5, reply
            alive = [a for a in everyone if a != killed]
            cluster.wait_all(3, alive, 2 * WEIGHTS_TIMEOUT)
            cast = _group(cluster, count)
            assert cast["formed"] > formed, cast
            assert cluster.ask("publish 4")["confirmed"]
            cluster.wait_all(4, alive, WEIGHTS_TIMEOUT)

            # SIGSTOP host 1's streamer: the next two versions reach everyone else within
            # weights_timeout (publish never waits longer than asked), and once resumed its
            # host catches up to the newest.
            weights = cluster.ask("stats")["weights"]
            stopped = cluster.streamer(hosts.names[1], weights)
            stopped_host = [a for a in alive if a // 100 == stopped // 100]
            others = [a for a in alive if a // 100 != stopped // 100]
            os.kill(cluster.actors[stopped].pid, signal.SIGSTOP)
            for version in (5, 6):
                started = time.monotonic()
                reply = cluster.ask(f"publish {version} {WEIGHTS_TIMEOUT}")
                assert time.monotonic() - started < WEIGHTS_TIMEOUT + 5, reply
                cluster.wait_all(version, others, 2 * WEIGHTS_TIMEOUT)
            os.kill(cluster.actors[stopped].pid, signal.SIGCONT)
            cluster.wait_all(6, stopped_host, 3 * WEIGHTS_TIMEOUT)
            # The group heals: every host in it again, and versions go by broadcast.
            version = 6
            while (cast := cluster.ask("stats")["weights"]["broadcast"])["members"] != count:
                assert version < 40, cast
                version += 1
                assert cluster.ask(f"publish {version}")["version"] == version
                time.sleep(0.5)
            before = cast["versions"]
            version += 1
            assert cluster.ask(f"publish {version}")["confirmed"]
            cluster.wait_all(version, alive, WEIGHTS_TIMEOUT)
            cast = cluster.ask("stats")["weights"]["broadcast"]
            assert cast["versions"] > before, cast
            stats = cluster.close()
        finally:
            cluster.kill_all()
    print(json.dumps(cast))
    assert sorted(stats) == sorted(alive), stats
    for actor_id in alive:
        assert all(v == "exact" for v in cluster.versions(actor_id).values()), cluster.lines[actor_id]
    assert cast["failures"] + cast["form_failures"] >= 1, cast


@pytest.mark.timeout(300)
def test_two_learner_ranks_each_broadcast_to_their_own_actors(tmp_path):
    """``Learner(distributed=True)``: two ranks on host 0, each with its own broadcast group of
    its own actors' hosts' streamers; actors on two other hosts know only rank 0's address."""
    from tests.integration.test_many_learners import ACTOR, JOB, clean_env, finish, results, wait_files

    versions, per_host = 12, 4
    common = {"RLINK_TOKEN": "cast-ranks-" + "x" * 32, "RLINK_WEIGHTS_FANOUT": "broadcast", "RLINK_WEIGHTS_TIMEOUT": "10",
              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}  # fmt: skip
    with Hosts(2, None) as hosts:
        ranks = [hosts.start(0, [sys.executable, str(JOB), "--out", str(tmp_path), "--address",
                                 f"{hosts.address(0)}:0", "--versions", str(versions), "--publish-every", "1.0",
                                 "--seconds", "120"], cwd=str(JOB.parents[2]),
                             env=clean_env(RANK=str(r), LOCAL_RANK=str(r), **common),
                             stdout=open(tmp_path / f"rank{r}.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
                 for r in range(2)]  # fmt: skip
        acts: list[Any] = []
        try:
            wait_files(tmp_path, ["address"], 90, ranks)
            for host in (1, 2):
                for i in range(per_host):
                    index = (host - 1) * per_host + i
                    acts.append(hosts.start(host, [sys.executable, str(ACTOR), "--out", str(tmp_path), "--index",
                                                   str(index), "--steps", "6000", "--versions", str(versions),
                                                   "--pace", "0.002"], cwd=str(JOB.parents[2]), env=clean_env(**common),
                                            stdout=open(tmp_path / f"actor{index}.log", "w"),  # noqa: SIM115
                                            stderr=subprocess.STDOUT))  # fmt: skip
            wait_files(tmp_path, [f"actor{i}.connected" for i in range(2 * per_host)], 90, [*ranks, *acts])
            (tmp_path / "go").touch()
            finish(acts, 150)
            finish(ranks, 60)
        finally:
            for p in [*ranks, *acts]:
                p.kill()
    got = results(tmp_path, 2 * per_host)
    for r in got:
        assert r["error"] is None and r["seen"][-1] == versions and r["w"] == versions and r["exact"], r
    by_rank: dict[int, list[dict]] = {0: [], 1: []}
    for r in got:
        by_rank[r["learner_rank"]].append(r)
    for rank, mine in by_rank.items():  # each rank's own actors, each rank's own group
        assert mine, by_rank
        cast = [r["weights"]["broadcast"] for r in mine]
        print(rank, [(r["index"], r["weights"]["broadcast"], r["weights"]["shared_reads"], r["weights"]["streamed"])
                     for r in mine])  # fmt: skip
        hosts_of_rank = {r["index"] // per_host for r in mine}
        assert sum(c > 0 for c in cast) == len(hosts_of_rank), (rank, cast, [r["index"] for r in mine])

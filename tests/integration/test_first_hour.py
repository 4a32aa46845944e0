"""What a newcomer meets first: start order, a learner that finishes, the end of a dataset,
the quickstart's own scripts, and the help text. Real processes on loopback."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlink_ucx import Actor, Closed, Config, ConnectError, Learner, RLinkDataset, cli
from tests.integration.procs import early_actor, putting_until_closed

SPAWN = mp.get_context("spawn")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_an_actor_started_before_its_learner_waits_for_it():
    port = free_port()
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=early_actor, args=(f"127.0.0.1:{port}", 500, results))
    proc.start()
    try:
        time.sleep(3.0)  # the actor is up, retrying, before any learner exists
        assert proc.is_alive(), "the actor gave up instead of waiting for its learner"
        with Learner(f"127.0.0.1:{port}", transport="tcp") as learner:
            dataset = RLinkDataset(learner, batch_size=500)
            kind, waited = results.get(timeout=30)
            assert kind == "connected" and waited >= 2.5
            assert dataset.fetch(timeout=30)["x"].tolist() == list(range(500))
            assert results.get(timeout=30) == ("done", 500)
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        proc.kill()


@pytest.mark.timeout(30)
def test_after_connect_timeout_the_error_says_how_long_it_tried():
    started = time.monotonic()
    with pytest.raises(ConnectError, match=r"cannot reach the learner at 127\.0\.0\.1:\d+: tried for 2s"):
        Actor(f"127.0.0.1:{free_port()}", config=Config(connect_timeout=2.0))
    assert 1.9 < time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_a_learner_that_closes_tells_its_actors_which_see_closed_at_once():
    results = SPAWN.Queue()
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        proc = SPAWN.Process(target=putting_until_closed, args=(learner.address, results))
        proc.start()
        assert results.get(timeout=30)[0] == "connected"
        dataset.fetch(timeout=30)
        closed_at = time.monotonic()
    try:
        kind, message, when = results.get(timeout=20)
        assert kind == "Closed" and "learner closed the session" in message
        assert when - closed_at < 3.0, "the actor noticed late: a reconnect loop or a credit timeout"
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        proc.kill()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterating_a_dataset_ends_once_every_actor_has_closed(drop_last):
    with Learner("127.0.0.1:0") as learner:
        dataset = RLinkDataset(learner, batch_size=64, stop_when_actors_done=True, drop_last=drop_last)
        queues = [SPAWN.Queue() for _ in range(2)]  # kept referenced until the children have started
        # Both stay connected a while: the stream ends when every actor that connected has closed.
        procs = [SPAWN.Process(target=early_actor, args=(learner.address, 100, q, 3.0)) for q in queues]
        for p in procs:
            p.start()
        started = time.monotonic()
        batches = [b["x"].tolist() for b in dataset]  # ends by itself: no fetch timeout
        assert time.monotonic() - started < 60
        for p in procs:
            p.join(10)
        sizes = [len(b) for b in batches]
        assert sizes == ([64, 64, 64] if drop_last else [64, 64, 64, 8])
        values = sorted(v for b in batches for v in b)
        if not drop_last:  # every step of both actors, once
            assert values == sorted(list(range(100)) * 2)
        with pytest.raises(Closed, match="every actor has finished"):
            dataset.fetch(timeout=5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("token", ["generated", "token-file"])
def test_the_quickstart_scripts_run_to_the_end_and_exit_cleanly(tmp_path, token):
    """As the quickstart shows them: on one host with no token typed (the learner writes one
    the actors find), and with a token file made by `rlink token`, as across hosts."""
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RLINK_TOKEN", None)
    env.pop("RLINK_TOKEN_FILE", None)
    secret: list[str] = []
    if token == "token-file":
        path = tmp_path / "rlink.token"
        subprocess.run([sys.executable, "-m", "rlink_ucx", "token", "--file", str(path)], check=True, cwd=ROOT,
                       env=env, capture_output=True, timeout=60)  # fmt: skip
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        secret = ["--token-file", str(path)]
        env["RLINK_TOKEN_DIR"] = str(tmp_path / "no-generated-tokens")  # the file is the only way in

    def start(*args: str, log: str) -> tuple[subprocess.Popen, Path]:
        path = tmp_path / log
        out = open(path, "w")  # noqa: SIM115 - closed with the process below
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), path

    # Actors first, as pods may start in any order; the learner stops early at a low target.
    actors = [start("examples/actor.py", "--address", address, "--seed", str(i), *secret, log=f"actor{i}.log")
              for i in (1, 2)]  # fmt: skip
    time.sleep(1.0)
    learner = start("examples/learner.py", "--address", address, "--target-return", "40", *secret, log="learner.log")
    procs = [learner, *actors]
    try:
        codes = [p.wait(timeout=200) for p, _ in procs]
    finally:
        for p, _ in procs:
            p.kill()
    logs = {path.name: path.read_text() for _, path in procs}
    if codes != [0, 0, 0]:  # every log in full (an assertion message would be cut short)
        pytest.fail(f"exit codes {codes}\n" + "\n".join(f"--- {name}\n{text}" for name, text in logs.items()))
    assert "solved: mean return" in logs["learner.log"], logs
    start_actors = f"start actors with: python examples/actor.py --address {address}{' '.join(['', *secret])}\n"
    assert start_actors in logs["learner.log"], logs["learner.log"]
    for name, text in logs.items():
        assert "Traceback" not in text, (name, text)
    for name in ("actor1.log", "actor2.log"):
        assert "actor exiting: the learner closed the session" in logs[name], logs[name]


def test_every_cli_option_has_help_and_info_is_listed_once(capsys):
    import argparse

    for argv in (["learner", "--help"], ["smoke", "--help"], ["info", "--help"], ["doctor", "--help"],
                 ["demo", "--help"]):  # fmt: skip
        with pytest.raises(SystemExit):
            cli.main(argv)
        out = capsys.readouterr().out
        options = [line for line in out.splitlines() if line.startswith("  --")]
        assert options, argv
        for line in options:  # an option with its help on the same line or the next
            name = line.split()[0]
            after = out.split(line, 1)[1].splitlines()
            helped = len(line.split()) > 2 or (after and after[1 if after[0] == "" else 0].startswith(" " * 20))
            assert helped, f"{argv[0]}: {name} has no help"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert top.count("library, UCX and CUDA versions") == 1 and top.count("check UCX, RDMA, CUDA") == 1
    assert isinstance(argparse.ArgumentParser, type)


def test_help_shows_the_attributes_a_user_reads():
    import pydoc

    import rlink_ucx

    actor_doc = pydoc.render_doc(rlink_ucx.Actor, renderer=pydoc.plaintext)
    for name in ("actor_id", "transport", "transport_reason", "policy_version", "shm"):
        assert name in actor_doc, name
    learner_doc = pydoc.render_doc(rlink_ucx.Learner, renderer=pydoc.plaintext)
    assert "address" in learner_doc.split("Readonly properties")[1]
    assert "shm" in learner_doc


def test_put_and_put_many_take_the_values_gymnasium_returns():
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=3)
        with Actor(learner.address, transport="tcp", schema={"obs": ("float32", (2,)), "reward": ("float32", ())}) as a:
            a.put({"obs": [0.5, 1.5], "reward": np.float64(1.0)})  # a list, a float64 reward
            a.put_many({"obs": np.ones((2, 2)), "reward": np.array([2.0, 3.0])})  # float64 arrays
            a.flush(10)
        batch = dataset.fetch(timeout=10)
        assert batch["obs"].tolist() == [[0.5, 1.5], [1.0, 1.0], [1.0, 1.0]]
        assert batch["reward"].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.timeout(60)
def test_put_many_given_a_list_of_steps_says_it_takes_a_mapping_of_arrays():
    with Learner("127.0.0.1:0", transport="tcp") as learner, Actor(learner.address, transport="tcp") as a:
        step = {"obs": np.zeros(2, np.float32), "reward": 1.0}
        for before in ([], [step]):  # before the schema is known, and after
            for put in before:
                a.put(put)
            with pytest.raises(TypeError, match=r"put_many takes a mapping of field name -> array .* not a list"):
                a.put_many([step, step, step])
        a.put_many({k: np.stack([s[k] for s in [step, step]]) for k in step})  # what the message says
        a.flush(10)
        assert learner.stats()["total"]["steps"] == 3


@pytest.mark.timeout(60)
def test_a_token_read_with_its_newline_matches_rlink_token_file_on_the_other_side(tmp_path, monkeypatch):
    path = tmp_path / "rlink-token"
    subprocess.run([sys.executable, "-m", "rlink_ucx", "token", "--file", str(path)], check=True, cwd=ROOT,
                   capture_output=True, timeout=60)  # fmt: skip
    monkeypatch.delenv("RLINK_TOKEN", raising=False)
    monkeypatch.setenv("RLINK_TOKEN_DIR", str(tmp_path / "no-generated-tokens"))
    with Learner("127.0.0.1:0", transport="tcp", token=path.read_text()) as learner:  # with its newline
        dataset = RLinkDataset(learner, batch_size=2)
        monkeypatch.setenv("RLINK_TOKEN_FILE", str(path))  # the actor's side strips the file's newline
        with Actor(learner.address, transport="tcp") as actor:
            actor.put_many({"x": np.arange(2, dtype=np.int64)})
            actor.flush(10)
        assert dataset.fetch(timeout=10)["x"].tolist() == [0, 1]


@pytest.mark.timeout(120)
def test_the_example_learner_on_a_wildcard_address_prints_an_actor_command_other_hosts_can_use(tmp_path):
    path = tmp_path / "rlink-token"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "rlink_ucx", "token", "--file", str(path)], check=True, cwd=ROOT,
                   env=env, capture_output=True, timeout=60)  # fmt: skip
    learner = subprocess.Popen([sys.executable, "examples/learner.py", "--address", "0.0.0.0:0", "--token-file",
                                str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)  # fmt: skip
    try:
        lines = []
        for line in learner.stdout:
            lines.append(line)
            if "start actors with" in line:
                break
    finally:
        learner.kill()
        learner.wait(30)
    command = lines[-1].split("start actors with: ", 1)[1].split()
    assert command[:3] == ["python", "examples/actor.py", "--address"], lines
    host, port = command[3].rsplit(":", 1)
    assert host == socket.gethostname() and int(port) > 0, lines
    assert command[4:] == ["--token-file", str(path)], lines

"""examples/ppo_onpolicy_learner.py and ppo_onpolicy_actor.py, run as a user runs them: the
learner script, then actor scripts given the address it prints, each in its own process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")

ROOT = Path(__file__).resolve().parents[2]
UPDATE = re.compile(r"update (\d+): version (\d+) from actors \[([\d, ]+)\], (\d+) env steps, mean return ([\d.]+)")


def run_example(actors: int, learner_args: list[str], timeout: float) -> tuple[list[str], list[tuple[int, str]]]:
    """The learner's output lines, and each actor's exit code and output."""
    learner = subprocess.Popen([sys.executable, "examples/ppo_onpolicy_learner.py", "--address", "127.0.0.1:0",
                                *learner_args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)  # fmt: skip
    assert learner.stdout is not None
    lines = [learner.stdout.readline()]
    address = re.search(r"learner on (\S+);", lines[0])
    assert address, lines
    procs = [subprocess.Popen([sys.executable, "examples/ppo_onpolicy_actor.py", "--address", address.group(1),
                               "--seed", str(i)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(actors)]  # fmt: skip
    try:
        out, _ = learner.communicate(timeout=timeout)
        lines += out.splitlines()
        assert learner.returncode == 0, lines
        return lines, [(p.wait(60), p.communicate()[0]) for p in procs]
    finally:
        for p in (learner, *procs):
            if p.poll() is None:
                p.kill()


@pytest.mark.timeout(150)
def test_the_on_policy_example_runs_updates_in_lockstep():
    lines, actors = run_example(2, ["--updates", "3", "--min-actors", "2"], timeout=120)
    updates = [UPDATE.search(line) for line in lines if line.startswith("update ")]
    assert len(updates) == 3 and all(updates), lines
    for i, m in enumerate(updates, 1):
        assert m is not None
        ids = [int(x) for x in m.group(3).split(",")]
        assert int(m.group(1)) == i and int(m.group(2)) == i  # update i trains on version i's rollouts
        assert len(set(ids)) == 2  # one rollout from each actor
        assert int(m.group(4)) == i * 2 * 128  # two rollouts of 128 env steps per update
        assert 8.0 <= float(m.group(5)) <= 500.0  # CartPole episodes last 8 to 500 steps
    assert lines[-1] == "learner done"
    for code, out in actors:
        assert code == 0 and "actor exiting: the learner closed the session" in out, out


@pytest.mark.slow  # 1-5 minutes here on 2 shared cores
@pytest.mark.timeout(1200)
def test_the_on_policy_example_reaches_a_mean_return_of_195():
    lines, actors = run_example(4, ["--updates", "800", "--target-return", "195"], timeout=1100)
    solved = [line for line in lines if line.startswith("solved: mean return ")]
    assert solved, lines[-5:]
    assert float(solved[0].split()[3]) >= 195.0
    assert all(code == 0 for code, _ in actors), actors

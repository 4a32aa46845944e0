"""docs/multi-learner.md's example, as written on the page: a torchrun job of 2 learner ranks
training a DDP model, and 4 actors given rank 0's address. Every actor loads every version the
ranks publish into its own (unwrapped) module, with the parameters the ranks hold."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.test_many_learners import clean_env, free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "multi-learner.md"
UPDATES = 5
ACTORS = 4


def doc_blocks() -> dict[str, str]:
    """The page's Python blocks that are whole scripts, by the file name on their first line."""
    blocks = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.DOTALL | re.MULTILINE)
    return {m.group(1): b for b in blocks if (m := re.match(r"# (\w+\.py),", b))}


def test_the_doc_shows_a_learner_and_an_actor_script():
    blocks = doc_blocks()
    assert sorted(blocks) == ["actor.py", "learner.py"]
    assert "DistributedDataParallel(policy)" in blocks["learner.py"] and "learner.publish(model" in blocks["learner.py"]
    assert 'init_process_group("nccl" if cuda else "gloo")' in blocks["learner.py"]
    assert "actor.load_remote_model(policy, newer_than=version)" in blocks["actor.py"]


def wait_for(path: Path, texts: list[str], job: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(t in path.read_text() for t in texts):
        assert job.poll() is None and time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_the_multi_learner_example_runs_as_written_and_every_actor_loads_every_version(tmp_path):
    for name, text in doc_blocks().items():
        (tmp_path / name).write_text(text)
    port = free_port()
    env = clean_env(RLINK_TOKEN="doc-example-" + uuid.uuid4().hex)
    env.pop("RLINK_LOG")
    log = tmp_path / "job.log"
    with open(log, "w") as out:  # the job writes to its own copy of the descriptor
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                "learner.py", f"127.0.0.1:{port}", str(UPDATES)],
                               cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    actors: list[subprocess.Popen] = []
    try:
        # Actors once every rank is up, so that rank 0 places two on each (docs: balanced).
        wait_for(log, ["learner rank 0 of 2 on", "learner rank 1 of 2 on"], job, 120)
        command = [sys.executable, "actor.py", f"127.0.0.1:{port}"]
        actors = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True) for _ in range(ACTORS)]  # fmt: skip
        outs = [p.communicate(timeout=200)[0] for p in actors]
        assert job.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        for p in [job, *actors]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in actors] == [0] * ACTORS, "\n---\n".join(o[-2500:] for o in outs)
    job_out = log.read_text()
    published: dict[int, dict[int, str]] = collections.defaultdict(dict)  # version -> rank -> parameter sum
    for rank, version, total in re.findall(r"^rank (\d) published version (\d+): parameter sum (\S+)$", job_out, re.MULTILINE):
        published[int(version)][int(rank)] = total
    versions = list(range(2, UPDATES + 2))
    assert sorted(published) == versions, job_out[-3000:]
    assert all(len(set(published[v].values())) == 1 and len(published[v]) == 2 for v in versions), published
    first: set[str] = set()
    ids = []
    for out in outs:
        loaded = re.findall(r"^actor (\d+) loaded version (\d+): parameter sum (\S+)$", out, re.MULTILINE)
        assert [int(v) for _, v, _ in loaded] == [1, *versions], out  # every version, in order
        assert all(total == published[int(v)][0] for _, v, total in loaded[1:]), (out, published)
        first.add(loaded[0][2])
        ids.append(int(loaded[0][0]))
        assert out.rstrip().endswith(f"actor {ids[-1]}: the learner ended"), out
        assert "Traceback" not in out and "Error" not in out, out
    assert len(first) == 1 and first.isdisjoint(published[2].values()), first  # version 1: the ranks' start
    assert sorted(ids) == [1, 2, 3, 4], ids

"""Every ```python example of README.md and docs/*.md runs as pasted (tests/integration/
doc_examples.py says how each is marked and run): a learner example with its actors (the doc's
own actor example, or stock actor processes), each a real process over loopback, each ending
with exit status 0 within its timeout. An unmarked block, a fragment without a reason and an
actor without its learner fail here."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlink_ucx.session.tokens import new_token, write_new
from tests.integration import doc_examples
from tests.integration.doc_examples import ROLES, ROOT, Block

BLOCKS = doc_examples.all_blocks()
RUN = [b for b in BLOCKS if b.role in ("run", "learner")]
LISTENING = re.compile(r"learner listening on (\S+):(\d+) ")


def test_every_python_block_is_marked_and_fragments_are_the_exception():
    assert len(BLOCKS) >= 8, [b.where for b in BLOCKS]
    for b in BLOCKS:
        assert b.role in ROLES, f"{b.where}: mark the block (<!-- example: run|learner|actor|fragment WHY -->)"
        if b.role == "fragment":
            assert b.note, f"{b.where}: a fragment says why it does not run"
        if b.role == "elsewhere":
            assert b.note.startswith("tests/"), f"{b.where}: name the test that runs it"
        if b.role == "actor":
            assert any(o.role == "learner" and o.path == b.path and o.name == b.name for o in BLOCKS), b.where
    fragments = [b.where for b in BLOCKS if b.role == "fragment"]
    assert len(fragments) <= len(BLOCKS) // 4, fragments
    for path in doc_examples.doc_files():  # a marker must sit on a block: none is left dangling
        lines = path.read_text().splitlines()
        markers = sum(1 for line in lines if line.strip().startswith("<!-- example:"))
        if not any(line.strip().startswith("<!-- examples:") for line in lines):
            assert markers == sum(1 for b in BLOCKS if b.path == str(path.relative_to(ROOT)) and b.role), path


def test_the_markers_are_read_as_written(tmp_path, monkeypatch):
    doc = tmp_path / "x.md"
    doc.write_text("text\n```python\nprint(1)\n```\n<!-- example: learner pair needs=jax,numpy -->\n\n```python\n"
                   "L = 1\n```\n<!-- example: fragment needs a GPU -->\n```python\nF\n```\n")  # fmt: skip
    page = tmp_path / "page.md"
    page.write_text("```python\nA\n```\n<!-- example: run -->\n```python\nB\n```\n"
                    "<!-- examples: elsewhere tests/x.py -->\n")  # fmt: skip
    monkeypatch.setattr(doc_examples, "ROOT", tmp_path)
    unmarked, learner, fragment = doc_examples.blocks(doc)
    assert (unmarked.role, unmarked.code, unmarked.line) == (None, "print(1)\n", 2)
    assert (learner.role, learner.name, learner.needs, learner.code) == ("learner", "pair", ["jax", "numpy"], "L = 1\n")
    assert (fragment.role, fragment.note) == ("fragment", "needs a GPU")
    first, second = doc_examples.blocks(page)
    assert (first.role, first.note, second.role) == ("elsewhere", "tests/x.py", "run")
    assert doc_examples.for_learner('Learner("0.0.0.0:8443", token=tok)') == 'Learner("0.0.0.0:0", token=tok)'
    assert doc_examples.for_actor('Actor("learner-host:8443")', "127.0.0.1:5") == 'Actor("127.0.0.1:5")'


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLINK_")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), RLINK_LOG="info", OMP_NUM_THREADS="1")
    return env


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


def _address(log: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = LISTENING.search(log.read_text())
        if found:
            return f"127.0.0.1:{found.group(2)}"
        assert proc.poll() is None, f"the learner example exited {proc.returncode} before listening:\n{_tail(log)}"
        time.sleep(0.05)
    raise AssertionError(f"the learner example did not listen within {timeout}s:\n{_tail(log)}")


def _start(code: str, name: str, where: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    (where / f"{name}.py").write_text(code)
    log = where / f"{name}.log"
    proc = subprocess.Popen([sys.executable, f"{name}.py"], cwd=where, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)  # fmt: skip
    return proc, log


@pytest.mark.timeout(420)
@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_the_example_runs_as_pasted(block: Block, tmp_path):
    missing = [m for m in block.needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)} (not installed)")
    write_new(str(tmp_path / ".rlink-token"), new_token())
    env = _env(tmp_path)
    if block.role == "run":
        proc = subprocess.run([sys.executable, "-c", doc_examples.for_learner(block.code)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        return
    learner, learner_log = _start(doc_examples.for_learner(block.code), "learner", tmp_path, env)
    actors: list[tuple[subprocess.Popen, Path]] = []
    try:
        address = _address(learner_log, learner, 120)
        mine = [b for b in BLOCKS if b.role == "actor" and b.path == block.path and b.name == block.name]
        for i, b in enumerate(mine):
            actors.append(_start(doc_examples.for_actor(b.code, address), f"actor{i}", tmp_path, env))
        if not mine:
            stock = f"import sys; from tests.integration.doc_examples import stock_actor; sys.exit(stock_actor({address!r}, " \
                    f"{str(tmp_path / '.rlink-token')!r}))"  # fmt: skip
            for i in range(2):
                actors.append(_start(stock, f"stock{i}", tmp_path, env))
        try:
            learner.wait(300)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{block.where}: the learner example did not end:\n{_tail(learner_log)}") from None
        assert learner.returncode == 0, f"{block.where}: the learner exited {learner.returncode}:\n{_tail(learner_log)}"
        for proc, log in actors:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{block.where}: an actor did not end after its learner:\n{_tail(log)}") from None
            assert proc.returncode == 0, f"{block.where}: an actor exited {proc.returncode}:\n{_tail(log)}"
    finally:
        for proc, _ in [*actors, (learner, learner_log)]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

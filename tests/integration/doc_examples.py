"""The fenced ```python examples of README.md and docs/*.md, and how each is run.

A marker on the line before a block (blank lines allowed) says what the block is:

    <!-- example: run [needs=mod,...] -->             a whole program, run alone
    <!-- example: learner NAME [needs=...] -->        a learner program; run with the blocks marked
                                                      `actor NAME` of the same file, or, with none,
                                                      beside stock actors (``stock_actor``)
    <!-- example: actor NAME [needs=...] -->          an actor program, run beside its learner
    <!-- example: fragment WHY -->                    not meant to run on its own (WHY is required)
    <!-- example: elsewhere tests/PATH -->            run as written by that test

``<!-- examples: ROLE ... -->`` (anywhere in a page) gives every block of the page without a
marker of its own that role: ``examples: elsewhere tests/PATH`` for a page whose blocks one test
runs together. An unmarked block fails the test. Each program runs in a fresh folder that is also its HOME,
with a 0600 ``~/.rlink-token`` (what the docs make with ``rlink token --file ~/.rlink-token``)
and no RLINK_* variables; the only edits are the ones a reader makes on a single host: a
learner's ``:8443`` becomes ``:0`` (any free port) and an actor's ``learner-host:8443`` the
address that learner logged. ``needs=`` names modules an example imports beyond the test
extras (its block is skipped where one is missing, as the gpu tier is without CUDA).

``python tests/integration/doc_examples.py ADDRESS TOKEN_FILE`` is the stock actor.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("run", "learner", "actor", "fragment", "elsewhere")
_MARKER = re.compile(r"^<!--\s*example:\s*(\S+)\s*(.*?)\s*-->\s*$")
_PAGE_MARKER = re.compile(r"^<!--\s*examples:\s*(\S+)\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence
    code: str
    role: str | None = None  # None: unmarked
    name: str = ""
    needs: list[str] = field(default_factory=list)
    note: str = ""  # a fragment's reason, or the test that runs an "elsewhere" block

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every ```python block of ``path`` with its marker (if any)."""
    lines = path.read_text().splitlines()
    page = next((m for m in (_PAGE_MARKER.match(line.strip()) for line in lines) if m), None)
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        block = Block(str(path.relative_to(ROOT)), start + 1, "\n".join(lines[start + 1:end]) + "\n")
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(before.strip())
        if marker or page:
            _read_marker(block, *(marker or page).groups())
        out.append(block)
        i = end + 1
    return out


def _read_marker(block: Block, role: str, rest: str) -> None:
    block.role = role
    words = rest.split()
    block.needs = [m for w in words if w.startswith("needs=") for m in w[6:].split(",") if m]
    words = [w for w in words if not w.startswith("needs=")]
    if role in ("learner", "actor"):
        block.name = words[0] if words else ""
    else:
        block.note = " ".join(words)


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def for_learner(program: str) -> str:
    return program.replace(':8443"', ':0"')


def for_actor(program: str, address: str) -> str:
    return program.replace('"learner-host:8443"', f'"{address}"')


def stock_actor(address: str, token_file: str) -> int:
    """Puts CartPole-like steps (obs float32[4], action, reward, done) until the learner closes."""
    import numpy as np

    from rlink_ucx import Actor, RLinkError, read_token_file

    rng = np.random.default_rng(0)
    try:
        with Actor(address, token=read_token_file(token_file)) as actor:
            while True:
                actor.put_many({"obs": rng.standard_normal((32, 4)).astype(np.float32),
                                "action": rng.integers(0, 2, 32), "reward": rng.random(32).astype(np.float32),
                                "done": rng.random(32) < 0.05})  # fmt: skip
                time.sleep(0.002)  # about 16,000 steps/s: the example, not this actor, should get the CPU
    except RLinkError:  # Closed: the learner finished
        return 0


if __name__ == "__main__":
    sys.exit(stock_actor(sys.argv[1], sys.argv[2]))

"""``gather.joined``: adjacent pieces of one ring chunk become one copy, nothing else merges."""

from __future__ import annotations

import random

import pytest

from rlink_ucx.store.gather import joined
from rlink_ucx.store.segments import Piece

pytestmark = pytest.mark.timeout(30)


def _runs(pieces: list[Piece], chunk_steps: int) -> list[tuple[int, int]]:
    """The (start, count) runs ``joined`` must give, step by step."""
    runs: list[list[int]] = []
    for p in pieces:
        if runs and runs[-1][0] + runs[-1][1] == p.start and p.start % chunk_steps:
            runs[-1][1] += p.count
        else:
            runs.append([p.start, p.count])
    return [(a, b) for a, b in runs]


def test_pieces_side_by_side_in_a_chunk_join_and_a_chunk_boundary_or_a_gap_splits():
    pieces = [Piece(0, 1, 1, 0, 0), Piece(1, 2, 2, 5, 0), Piece(3, 1, 3, 9, 0), Piece(8, 1, 4, 0, 0),
              Piece(9, 1, 5, 0, 0), Piece(11, 1, 6, 0, 0)]  # fmt: skip
    out = joined(pieces, 8)
    assert [(p.start, p.count) for p in out] == [(0, 4), (8, 2), (11, 1)]
    assert out[2] is pieces[5]  # a piece on its own is handed on as it is
    assert joined([], 8) == []


def test_random_pieces_join_into_the_runs_a_step_by_step_walk_finds():
    rng = random.Random(7)
    for _ in range(200):
        chunk, pos, pieces = rng.choice([4, 8, 32]), rng.randrange(64), []
        for _ in range(rng.randrange(1, 40)):
            count = rng.randrange(1, 5)
            count = min(count, chunk - pos % chunk)  # a piece never crosses a chunk
            pieces.append(Piece(pos, count, 0, 0, 0))
            pos += count + (rng.randrange(3) if rng.random() < 0.2 else 0)
        got = [(p.start, p.count) for p in joined(pieces, chunk)]
        assert got == _runs(pieces, chunk)
        assert sum(c for _, c in got) == sum(p.count for p in pieces)

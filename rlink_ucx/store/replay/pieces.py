"""The pieces of one take from the learner's ring, grouped for the replay's inserts.

A take is a list of :class:`Piece` (one frame's steps within one ring chunk). The inserter
works on fewer, larger units: runs of consecutive ring positions (one copy each), runs of one
actor's consecutive steps (one metadata update each), and the take's ring chunks, of which a
whole one may be taken into a :class:`BlockTable` without copying.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..ring import Piece, StepRing

if TYPE_CHECKING:
    from .block_table import BlockTable

__all__ = ["ChunkGroup", "chunk_groups", "contiguous", "streams"]


@dataclass
class ChunkGroup:
    pieces: list[Piece]  # consecutive pieces of one ring chunk
    count: int
    whole: bool  # exactly the whole chunk (StepRing.lend_chunk can swap it)
    adopt: int | None  # the table block the chunk is, if it is one (then no copy is needed)


def contiguous(pieces: list[Piece], chunk_steps: int) -> Iterator[Piece]:
    """``pieces`` merged where one ends at the ring position where the next begins, within one
    ring chunk (each chunk is an array of its own)."""
    return _merged(pieces, lambda run, p: run.start + run.count == p.start and p.start % chunk_steps != 0)


def streams(pieces: list[Piece]) -> Iterator[Piece]:
    """``pieces`` merged where the next continues the same actor's steps (same behaviour
    version, next sequence number): one metadata update per merged run."""
    return _merged(pieces, lambda run, p: (p.actor_id, p.version, p.seq) == (run.actor_id, run.version,
                                                                           run.seq + run.count))  # fmt: skip


def _merged(pieces: list[Piece], joins: Callable[[Piece, Piece], bool]) -> Iterator[Piece]:
    """``pieces`` in order, each merged into the run before it where ``joins(run, piece)``."""
    run: Piece | None = None
    for p in pieces:
        if run is not None and joins(run, p):
            run = replace(run, count=run.count + p.count)
            continue
        if run is not None:
            yield run
        run = p
    if run is not None:
        yield run


def chunk_groups(ring: StepRing, pieces: list[Piece], fields: list[int], table: BlockTable) -> list[ChunkGroup]:
    """``pieces`` grouped by ring chunk, in order; for a whole chunk, the table block it is."""
    k = ring.chunk_steps
    groups: list[ChunkGroup] = []
    for p in pieces:
        c = p.start // k
        last = groups[-1].pieces[-1] if groups else None
        if last is not None and last.start // k == c and last.start + last.count == p.start:
            groups[-1].pieces.append(p)
            groups[-1].count += p.count
        else:
            groups.append(ChunkGroup([p], p.count, False, None))
    for g in groups:
        g.whole = g.pieces[0].start % k == 0 and g.count == k
        if g.whole:
            chunk = ring.chunks[g.pieces[0].start // k]
            g.adopt = table.owned_block([chunk[i] for i in fields])
    return groups

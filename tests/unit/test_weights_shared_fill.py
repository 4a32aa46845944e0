"""A snapshot in shared memory is tagged from a private copy of each bucket, never from the
memfd other processes of the user can write (issue 40, finding 4)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from rlink_ucx import ProtocolError
from rlink_ucx.transport.shm.memory import DATA_OFFSET
from rlink_ucx.weights import mac
from rlink_ucx.weights import snapshot as snapshot_module
from rlink_ucx.weights.shared import available
from rlink_ucx.weights.snapshot import BufferPool, begin_snapshot, fill, sources

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not available(), reason="no memfd here")]


def state(f_len: int = 2_500_001) -> dict[str, torch.Tensor]:
    # Sizes that are no multiple of the alignment, a row or the bucket: buckets start and end
    # inside tensors, and some hold padding and several tensors; "f" spans several 4 MiB pieces
    # (at its full length).
    return {"a": torch.arange(1000, dtype=torch.float32), "b": torch.full((7,), 3, dtype=torch.int8),
            "c": torch.arange(3001, dtype=torch.float64), "d": torch.ones(0), "e": torch.randn(257),
            "f": torch.randn(f_len)}  # fmt: skip


# A 64-byte bucket is one piece, never staged in several: a shorter "f" still makes ~1,700 of
# them, each tagged and verified (the full length made 160,000, 30-50 s of the suite).
@pytest.mark.parametrize("bucket, f_len", [(64, 20_001), (4096, 2_500_001), (12352, 2_500_001),
                                           (1 << 20, 2_500_001), (32 << 20, 2_500_001)])  # fmt: skip
def test_a_shared_snapshot_holds_every_tensor_and_its_tags_verify(bucket, f_len):
    pool = BufferPool(shared=True)
    s = state(f_len)
    snap = begin_snapshot(s, 1, bucket, pool)
    assert snap.shared is not None
    if f_len == 20_001:
        assert len(snap.manifest.buckets()) > 1500  # buckets inside every tensor, many of them
    else:
        assert snap.manifest.total_bytes > 2 * snapshot_module._PIECE  # a large bucket is staged in several pieces
    fill(snap, sources(snap, s))
    assert snap.sealed and len(snap.tags) == len(snap.manifest.buckets())
    snap.verify()  # every bucket's tag over the bytes in shared memory
    for name, t in snap.tensors().items():
        assert torch.equal(t, s[name]), name


def test_bytes_written_into_the_memfd_while_it_is_filled_fail_their_tags(monkeypatch):
    """Another process of the user writes into the memfd each time the learner hashes a piece:
    the tags, taken from the private copy, do not vouch for its bytes. (1 MiB buckets: 11 pieces,
    each followed by a write of the whole memfd; 4 KiB ones made 2,500 such writes, 17 s.)"""
    pool = BufferPool(shared=True)
    s = state()
    snap = begin_snapshot(s, 1, 1 << 20, pool)
    assert len(snap.manifest.buckets()) > 2
    pid, fd, _, size = snap.shared
    original = mac.BucketTagger.update
    pieces = []

    def write_then_tag(tagger: Any, data: Any) -> None:
        other = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)  # as another process would
        try:
            os.pwrite(other, np.full(size // 4, np.inf, dtype=np.float32).tobytes(), DATA_OFFSET)
        finally:
            os.close(other)
        pieces.append(len(data))
        original(tagger, data)

    monkeypatch.setattr(mac.BucketTagger, "update", write_then_tag)
    fill(snap, sources(snap, s))
    monkeypatch.setattr(mac.BucketTagger, "update", original)  # verify reads the memfd as it is
    assert len(pieces) >= len(snap.manifest.buckets()) and max(pieces) <= snapshot_module._PIECE
    with pytest.raises(ProtocolError, match="failed its MAC"):
        snap.verify()

"""CUDA paths: batches on cuda:0, CUDA tensors put by actors. Skipped without a GPU."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from rlink_ucx import Actor, Learner, RLinkDataset  # noqa: E402
from tests.conftest import TRANSPORTS  # noqa: E402


def _cuda_actor(address: str, transport: str, n: int) -> None:
    import torch

    with Actor(address, transport=transport, actor_id=1) as actor:
        for start in range(0, n, 50):
            seq = torch.arange(start, start + 50, device="cuda:0")
            actor.put_many({"obs": seq[:, None].float().repeat(1, 8), "action": seq})
        actor.flush(60)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cuda_tensors_in_batches_on_cuda(transport):
    n = 2000
    with Learner("127.0.0.1:0", transport=transport) as learner:
        dataset = RLinkDataset(learner, batch_size=500, device="cuda:0")
        proc = mp.get_context("spawn").Process(target=_cuda_actor, args=(learner.address, transport, n))
        proc.start()
        seqs = []
        for _ in range(n // 500):
            batch = dataset.fetch(timeout=60)
            assert batch["obs"].device.type == "cuda" and batch.seq.device.type == "cuda"
            assert torch.equal(batch["obs"][:, 0].long(), batch["action"])
            assert torch.equal(batch["action"], batch.seq)
            seqs += batch.seq.tolist()
        proc.join(60)
        assert proc.exitcode == 0
    assert seqs == list(range(n))


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_batches_survive_the_next_fetch_on_cuda():
    with Learner("127.0.0.1:0") as learner:
        dataset = RLinkDataset(learner, batch_size=4, device="cuda:0")
        with Actor(learner.address) as actor:
            actor.put_many({"x": np.arange(16, dtype=np.int64)})
            actor.flush(10)
            first = dataset.fetch(timeout=10)
            rest = [dataset.fetch(timeout=10) for _ in range(3)]
        torch.cuda.synchronize()
        assert first["x"].tolist() == [0, 1, 2, 3]
        assert rest[-1]["x"].tolist() == [12, 13, 14, 15]

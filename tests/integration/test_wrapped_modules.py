"""A compiled module published by a real learner reaches a real actor under the inner module's
names: a plain module and a compiled one on the actor both load it."""

from __future__ import annotations

import pytest

from rlink_ucx import Actor, Learner

torch = pytest.importorskip("torch")


def policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.timeout(120)
def test_a_compiled_learner_module_loads_into_plain_and_compiled_actor_modules():
    source = policy(1)
    with Learner("127.0.0.1:0", transport="tcp") as learner, Actor(learner.address, transport="tcp") as actor:
        assert learner.publish(torch.compile(source)) == 1
        state, version = actor.get_remote_model(timeout=30)
        assert version == 1 and sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        plain, inner = policy(2), policy(3)
        compiled = torch.compile(inner)
        assert actor.load_remote_model(plain, timeout=30) == 1
        assert actor.load_remote_model(compiled, timeout=30) == 1
    for target in (plain, inner):
        for name, tensor in source.state_dict().items():
            assert torch.equal(target.state_dict()[name], tensor), name


def sharded_rank(rank: int, store: str, results) -> None:
    """One of two ranks: an FSDP2 (``fully_shard``) model, really split in two, published as
    ``publish()`` reads it: the full tensors under the inner names, on every rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from rlink_ucx.weights.snapshot import state_dict_of

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        two = policy(1)
        fully_shard(two[0])
        fully_shard(two)
        local = two.state_dict()["0.weight"].to_local().shape[0]  # this rank's half of the rows
        one = FullyShardedDataParallel(policy(1), device_id=torch.device("cpu"))
        results.put((rank, local, {k: v.tolist() for k, v in state_dict_of(two).items()},
                     {k: v.tolist() for k, v in state_dict_of(one).items()}))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_fsdp_split_over_two_ranks_publishes_the_full_model_on_each(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=sharded_rank, args=(r, str(tmp_path / "store"), results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    expected = {k: v.tolist() for k, v in policy(1).state_dict().items()}
    for rank, local_rows, fsdp2, fsdp1 in got:
        assert local_rows == 4, "each rank holds half of the 8 rows"
        assert fsdp2 == expected and fsdp1 == expected, rank

"""publish() takes what users train (DDP, FSDP, torch.compile) and names parameters as the inner
module does; load_remote_model's unwrap step finds the module a wrapper stands for."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from rlink_ucx import ConfigError
from rlink_ucx.weights.snapshot import state_dict_of
from rlink_ucx.weights.unwrap import inner_module

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def policy() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def assert_same(published: dict, module: torch.nn.Module) -> None:
    assert list(published) == NAMES
    for name, tensor in module.state_dict().items():
        assert torch.equal(published[name], tensor), name


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group, as a DDP learner of world size 1 has (destroyed afterwards)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ddp_publishes_the_inner_modules_names(group: None) -> None:
    plain = policy()
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    assert next(iter(ddp.state_dict())) == "module.0.weight"  # what publish() sent before
    assert_same(dict(state_dict_of(ddp)), plain)
    assert inner_module(ddp) is plain


def test_compiled_module_publishes_and_loads_under_its_own_names() -> None:
    plain = policy()
    compiled = torch.compile(plain)
    assert next(iter(compiled.state_dict())) == "_orig_mod.0.weight"
    assert_same(dict(state_dict_of(compiled)), plain)
    # The load side: a compiled module on an actor takes a plain state dict.
    target = policy()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    inner_module(torch.compile(target)).load_state_dict(dict(state_dict_of(compiled)))
    assert_same(dict(target.state_dict()), plain)


def test_compiled_ddp_and_ddp_of_compiled_unwrap_every_layer(group: None) -> None:
    plain = policy()
    outer = torch.compile(torch.nn.parallel.DistributedDataParallel(plain))
    assert next(iter(outer.state_dict())) == "_orig_mod.module.0.weight"
    assert_same(dict(state_dict_of(outer)), plain)
    assert inner_module(outer) is plain
    other = policy()
    assert inner_module(torch.nn.parallel.DistributedDataParallel(torch.compile(other))) is other


def test_a_users_own_submodule_named_module_keeps_its_name() -> None:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 3)

    holder = Holder()
    assert list(state_dict_of(holder)) == ["module.weight", "module.bias"]
    assert inner_module(holder) is holder


def test_fsdp_publishes_a_full_state_dict_under_the_inner_names(group: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    plain = policy()
    reference = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's own notes on world size 1 and deprecations
        sharded = FullyShardedDataParallel(plain, device_id=torch.device("cpu"))
        published = dict(state_dict_of(sharded))
    assert_same(published, reference)
    assert all(type(t) is torch.Tensor for t in published.values())


def test_fully_shard_dtensors_are_gathered_into_whole_tensors(group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    plain = policy()
    reference = copy.deepcopy(plain)
    fully_shard(plain[0])
    fully_shard(plain)
    assert type(plain.state_dict()["0.weight"]).__name__ == "DTensor"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        published = dict(state_dict_of(plain))
    assert_same(published, reference)
    assert all(type(t) is torch.Tensor for t in published.values())
    assert published["0.weight"].shape == (8, 4)



def test_fsdp_that_cannot_be_gathered_is_refused_with_a_config_error(group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):  # deferred initialisation, never materialised: no data to gather
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(plain)
    with pytest.raises(ConfigError, match=r"^publish\(\): cannot gather the full state dict of the FSDP-sharded "
                       r"FSDPSequential \(NotImplementedError: .*meta") as info:  # fmt: skip
        state_dict_of(plain)
    assert isinstance(info.value.__cause__, NotImplementedError)

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

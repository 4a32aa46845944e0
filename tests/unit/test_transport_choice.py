"""transport="auto" and explicit choices, decided per actor."""

import pytest

from rlink_ucx.transport import choose
from rlink_ucx.transport.ucx import probe as ucx_probe


@pytest.mark.parametrize(
    "learner, actor, learner_ucx, actor_ucx, expected",
    [
        ("tcp", "auto", True, True, "tcp"),
        ("auto", "tcp", True, True, "tcp"),
        ("ucx", "auto", True, True, "ucx"),
        ("auto", "ucx", True, True, "ucx"),
        ("ucx", "auto", True, False, ""),  # the actor lacks ucxx: refused, with a reason
        ("ucx", "tcp", True, True, ""),  # contradictory explicit choices
        ("auto", "auto", False, True, "tcp"),
    ],
)
def test_explicit_choices_and_missing_ucx(learner, actor, learner_ucx, actor_ucx, expected):
    picked, reason = choose(learner, actor, learner_ucx=learner_ucx, actor_ucx=actor_ucx)
    assert picked == expected and reason
    if not expected:
        assert "ucx" in reason


def test_auto_picks_ucx_only_for_rdma_or_cuda(monkeypatch):
    monkeypatch.setattr(ucx_probe, "transports", lambda: {"tcp": ["lo"], "sysv": ["memory"], "cma": ["memory"]})
    assert choose("auto", "auto", learner_ucx=True, actor_ucx=True)[0] == "tcp"
    monkeypatch.setattr(ucx_probe, "transports", lambda: {"tcp": ["lo"], "rc_mlx5": ["mlx5_0:1"]})
    picked, reason = choose("auto", "auto", learner_ucx=True, actor_ucx=True)
    assert picked == "ucx" and "rc_mlx5" in reason


@pytest.mark.parametrize(
    "learner, actor, same_host, shm, expected",
    [
        ("auto", "auto", True, True, "shm"),  # same host: the shared ring
        ("auto", "auto", False, True, "tcp"),  # another host: never shm
        ("auto", "auto", True, False, "tcp"),  # a side cannot map a memfd ring
        ("shm", "auto", True, True, "shm"),
        ("auto", "shm", False, True, ""),  # requested across hosts: refused, with a reason
        ("shm", "auto", True, False, ""),
        ("tcp", "auto", True, True, "tcp"),  # an explicit tcp wins over the same-host default
        ("shm", "tcp", True, True, ""),
    ],
)
def test_shm_only_between_processes_on_one_host(learner, actor, same_host, shm, expected):
    picked, reason = choose(learner, actor, learner_ucx=False, actor_ucx=False, same_host=same_host, shm=shm)
    assert picked == expected and reason
    if expected == "" and "shm" in (learner, actor) and "tcp" not in (learner, actor):
        assert "shm" in reason


def test_same_host_auto_prefers_ucx_only_for_cuda_transports(monkeypatch):
    monkeypatch.setattr(ucx_probe, "transports", lambda: {"tcp": ["lo"], "sysv": ["memory"], "cma": ["memory"]})
    assert choose("auto", "auto", learner_ucx=True, actor_ucx=True, same_host=True, shm=True)[0] == "shm"
    monkeypatch.setattr(ucx_probe, "transports", lambda: {"tcp": ["lo"], "cuda_ipc": ["cuda"]})
    picked, reason = choose("auto", "auto", learner_ucx=True, actor_ucx=True, same_host=True, shm=True)
    assert picked == "ucx" and "cuda_ipc" in reason


@pytest.mark.timeout(30)
def test_a_refusal_for_missing_ucx_gives_the_install_command_for_cpu_and_cuda():
    transport, why = choose("ucx", "auto", learner_ucx=False, actor_ucx=True)
    assert transport == "" and "the learner offers none" in why
    assert "pip install 'rlink-ucx[ucx]' (CPU) or 'rlink-ucx[cu12]' / 'rlink-ucx[cu13]'" in why

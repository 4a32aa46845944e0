"""A job of many learner ranks without torch.distributed (session/learner/ranks/job.py): rank and
world size from the launcher's environment, the rank token's rules, and rank 0's job file by
which the ranks on its host find its port and generated rank token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlink_ucx import Config, ConfigError
from rlink_ucx.session.learner.ranks import job as _job

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "abc"}  # fmt: skip


def test_rank_and_world_come_from_the_launcher_and_name_the_job():
    job = _job.find_job("127.0.0.1:0", TORCHRUN)
    assert (job.rank, job.world, job.spans_hosts) == (1, 2, False) and len(job.rendezvous) == 32
    assert _job.find_job("127.0.0.1:0", {**TORCHRUN, "RANK": "0"}).rendezvous == job.rendezvous  # every rank: one name
    assert _job.find_job("127.0.0.1:0", {**TORCHRUN, "MASTER_PORT": "29501"}).rendezvous != job.rendezvous
    slurm = _job.find_job("h:8443", {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7"})
    assert (slurm.rank, slurm.world, slurm.spans_hosts) == (3, 4, True) and slurm.rendezvous
    bare = _job.find_job("h:8443", {"RANK": "0", "WORLD_SIZE": "2"})
    assert bare.rendezvous == "" and bare.spans_hosts is None
    with pytest.raises(ConfigError, match="no launcher's variables"):
        _job.find_job("h:8443", {})
    with pytest.raises(ConfigError, match="rank 2 is not a rank of a job of 2"):
        _job.find_job("h:8443", {"RANK": "2", "WORLD_SIZE": "2"})


def test_rank_0_refuses_what_the_other_ranks_could_not_follow():
    across = _job.Job(0, 2, "k" * 32, True)
    with pytest.raises(ConfigError, match="more than one host: give every learner rank the same rank token"):
        _job.rank_0_token(across, None)
    with pytest.raises(ConfigError, match="no launcher's rendezvous"):
        _job.rank_0_token(_job.Job(0, 2, "", None), None)
    with pytest.raises(ConfigError, match="port 0: the job's ranks run on more than one host"):
        _job.check_rank_0_port(across, 0)
    with pytest.raises(ConfigError, match="port 0: no launcher's rendezvous"):
        _job.check_rank_0_port(_job.Job(0, 2, "", None), 0)
    _job.check_rank_0_port(across, 8443)  # a fixed port is fine
    assert _job.rank_0_token(across, b"x" * 32) == b"x" * 32
    generated = _job.rank_0_token(_job.Job(0, 2, "k" * 32, False), None)
    assert len(generated) >= 32 and generated != _job.rank_0_token(_job.Job(0, 2, "k" * 32, False), None)


def test_the_rank_token_is_not_the_actors_token(monkeypatch, tmp_path):
    monkeypatch.setenv("RLINK_RANK_TOKEN", "the-same-secret-for-everyone")
    with pytest.raises(ConfigError, match="the rank token is the actors' token"):
        _job.given_rank_token(Config(), b"the-same-secret-for-everyone")
    assert _job.given_rank_token(Config(), b"another-secret-0123456789") == b"the-same-secret-for-everyone"
    monkeypatch.delenv("RLINK_RANK_TOKEN")
    path = tmp_path / "rank-token"
    path.write_text("rank-token-from-a-file-0123456789\n")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="accessible by group/others"):
        _job.given_rank_token(Config(rank_token_file=str(path)), None)
    os.chmod(path, 0o600)
    assert _job.given_rank_token(Config(rank_token_file=str(path)), None) == b"rank-token-from-a-file-0123456789"
    assert _job.given_rank_token(Config(), None) is None


def test_ranks_on_rank_0_s_host_find_its_port_and_rank_token_in_the_job_file(tmp_path):
    config = Config(token_dir=str(tmp_path / "tokens"), connect_timeout=1)
    job = _job.Job(0, 2, "f" * 32, False)
    path = _job.publish_rank_0(config, job, 40123, b"generated-rank-token-0123456789")
    assert path is not None and (os.stat(path).st_mode & 0o777) == 0o600
    assert (os.stat(path.parent).st_mode & 0o777) == 0o700
    word = _job.await_rank_0(config, _job.Job(1, 2, "f" * 32, False), "127.0.0.1", 0.0)
    assert word == _job.RankZero(40123, b"generated-rank-token-0123456789")
    plan = _job.plan_rank(_job.Job(1, 2, "f" * 32, False), config, ("127.0.0.1", 0), b"actors-token-0123456789", False)
    assert plan.home == ("127.0.0.1", 40123) and plan.rank_token == b"generated-rank-token-0123456789"
    assert plan.bind == ("127.0.0.1", 0) and plan.actor_token is None  # the actors' token was given
    _job.withdraw_rank_0(path)
    assert not path.exists()


def test_a_job_file_left_by_a_dead_rank_0_is_not_read(tmp_path):
    config = Config(token_dir=str(tmp_path / "tokens"), connect_timeout=1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    body = f'{{"port": 40124, "pid": {int(dead.stdout)}, "rank_token": "stale-rank-token-0123456789"}}'.encode()
    from rlink_ucx.session import tokens

    tokens.publish_private(config, _job.Job(0, 2, "e" * 32, False).job_file, body, "a stale job file")
    with pytest.raises(ConfigError, match="rank 0 wrote no job file on this host in time"):
        _job.await_rank_0(config, _job.Job(1, 2, "e" * 32, False), "127.0.0.1", 0.0)


def test_a_rank_on_another_host_than_rank_0_needs_a_fixed_port_and_the_rank_token(tmp_path):
    config = Config(token_dir=str(tmp_path / "tokens"), connect_timeout=1)
    job = _job.Job(1, 2, "d" * 32, None)
    with pytest.raises(ConfigError, match="on another host: give every rank a fixed port"):
        _job.plan_rank(job, config, ("192.0.2.1", 8443), b"actors-token-0123456789", False)  # TEST-NET: not ours

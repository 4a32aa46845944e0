"""Replay checkpoints and token files are their user's alone: files 0600 in 0700 directories,
whatever the umask."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from rlink_ucx import Config, ReplayDataset
from rlink_ucx.session import tokens
from tests.unit.replay_helpers import FakeLearner, new_ring, put, wait_for


@pytest.fixture(params=[0o022, 0o000, 0o277], ids=lambda u: f"umask{u:03o}")
def umask(request: pytest.FixtureRequest):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_helpers_set_the_modes_whatever_the_umask(tmp_path, umask) -> None:
    from rlink_ucx.store.private_files import create_private, make_private_dir

    make_private_dir(tmp_path / "d")
    fd = create_private(tmp_path / "d" / "f")
    os.write(fd, b"x")
    os.close(fd)
    assert mode(tmp_path / "d") == 0o700 and mode(tmp_path / "d" / "f") == 0o600
    with pytest.raises(FileExistsError):
        create_private(tmp_path / "d" / "f")  # never an existing file
    os.symlink(tmp_path / "elsewhere", tmp_path / "d" / "link")
    with pytest.raises(OSError):
        create_private(tmp_path / "d" / "link")  # never through a link
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.timeout(60)
def test_a_replay_checkpoint_is_private_whatever_the_umask(tmp_path, umask) -> None:
    with ReplayDataset(FakeLearner(new_ring()), capacity=100, batch_size=20, sampler="prioritized", seed=0) as r:
        put(r.learner.ring, 1, 0, 40, frame=16)
        assert wait_for(lambda: r.inserted == 40)
        r.save(tmp_path / "ckpt")
        r.save(tmp_path / "ckpt")  # a replacing save too
    ckpt = tmp_path / "ckpt"
    assert mode(ckpt) == 0o700
    files = sorted(p.name for p in ckpt.iterdir())
    assert "manifest.json" in files and "meta.npy" in files and "priority.npy" in files
    assert {p.name: mode(p) for p in ckpt.iterdir()} == dict.fromkeys(files, 0o600)
    with ReplayDataset.load(ckpt, FakeLearner(new_ring())) as q:  # and it still loads
        assert len(q) == 40
        np.testing.assert_array_equal(np.sort(q._core.table.seq[:40]), np.arange(40))


def test_token_files_keep_their_modes_whatever_the_umask(tmp_path, umask) -> None:
    path = tokens.publish(Config(token_dir=str(tmp_path / "tokens")), 8443, b"t" * 32)
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    tokens.write_new(str(tmp_path / "mine" / "token"), "s" * 32)
    assert mode(tmp_path / "mine" / "token") == 0o600

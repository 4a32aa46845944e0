"""Where a learner given no token keeps the one it generates, when the usual place is taken.

Another user can create ``/tmp/rlink-<uid>`` before the victim's first learner (any user may
create names in ``/tmp``). The learner then keeps its token in the next private place, and the
same user's actors, which look in the same places in the same order, still connect."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from rlink_ucx import Learner, RLinkDataset
from tests.integration.procs import small_actor
from tests.integration.test_datapath import join_all

SPAWN = mp.get_context("spawn")
NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (setpriv)")


@pytest.fixture
def private_places(monkeypatch, tmp_path, request):
    """A /tmp of our own (mode 1777, like /tmp) and a HOME of our own, no runtime dir."""
    # Under /tmp itself: another user must be able to reach it (pytest's tmp_path is 0700).
    tmp = Path(tempfile.mkdtemp(prefix="rlink-test-tmp-", dir="/tmp"))
    tmp.chmod(0o1777)
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    for name in ("RLINK_TOKEN", "RLINK_TOKEN_FILE", "RLINK_TOKEN_DIR", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    return tmp, home


def as_nobody(*argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                   check=True, timeout=30)  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("squat", ["directory", "symlink"])
def test_a_token_directory_squatted_by_another_user_moves_the_token_and_actors_still_connect(private_places, squat):
    tmp, home = private_places
    squatted = tmp / f"rlink-{os.geteuid()}"
    if squat == "directory":
        as_nobody("mkdir", "-m", "0777", str(squatted))
    else:
        as_nobody("ln", "-s", str(tmp), str(squatted))
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        path = Path(learner.token_file)
        assert path.parent == home / ".cache" / "rlink" / "tokens", path
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert not squatted.is_symlink() or os.listdir(tmp) == [squatted.name]  # nothing written through the link
        dataset = RLinkDataset(learner, batch_size=10)
        proc = SPAWN.Process(target=small_actor, args=(learner.address, "tcp", 3, 10))
        proc.start()
        batch = dataset.fetch(timeout=60)
        assert join_all([proc]) == [0]
        assert set(batch.actor_id.tolist()) == {3} and sorted(batch.seq.tolist()) == list(range(10))
    assert squat == "symlink" or os.listdir(squatted) == []

"""The doctor's checks on situations this machine does not have: RDMA devices, a small
/dev/shm, a low somaxconn, token files open to others (no network)."""

from __future__ import annotations

import os

import pytest

from rlink_ucx.config import Config
from rlink_ucx.doctor import checks as doctor


def fake_rdma(root, state: str):
    port = root / "sys" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text("InfiniBand\n")
    return str(root / "sys")


def test_rdma_device_without_uverbs_asks_for_the_device_in_containers(tmp_path):
    check = doctor.check_rdma(fake_rdma(tmp_path, "4: ACTIVE"), str(tmp_path / "dev"))
    assert check.status == "warn" and "--device /dev/infiniband" in check.advice
    assert check.data["devices"] == {"mlx5_0": [{"port": "1", "state": "4: ACTIVE", "link_layer": "InfiniBand"}]}
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "uverbs0").write_text("")
    check = doctor.check_rdma(str(tmp_path / "sys"), str(tmp_path / "dev"))
    assert check.data["uverbs"] == ["uverbs0"] and check.data["active"] == ["mlx5_0"]
    assert check.status == ("ok" if check.data["memlock_soft"] == -1 or check.data["memlock_soft"] >= 64 << 20
                            else "warn")  # fmt: skip


def test_rdma_port_down_is_a_warning(tmp_path):
    check = doctor.check_rdma(fake_rdma(tmp_path, "1: DOWN"), str(tmp_path / "dev"))
    assert check.status == "warn" and "ACTIVE" in check.advice and check.data["active"] == []


def test_no_rdma_is_fine(tmp_path):
    check = doctor.check_rdma(str(tmp_path / "absent"))
    assert check.status == "ok" and check.data["devices"] == {}


def test_shm_too_small_for_the_rings_of_the_expected_actors(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    config = Config()
    many = free // config.shm_ring_bytes + 1
    check = doctor.check_shm(config, many, str(tmp_path))
    assert check.status == "warn" and check.data["need_bytes"] == many * config.shm_ring_bytes > free
    assert "--shm-size" in check.advice
    assert doctor.check_shm(config, 1, str(tmp_path / "absent")).status == "warn"


def test_low_somaxconn_is_a_warning_with_the_sysctl(tmp_path):
    path = tmp_path / "somaxconn"
    path.write_text("128\n")
    check = doctor.check_somaxconn(Config(), str(path))
    assert check.status == "warn" and check.data == {"somaxconn": 128, "backlog": 1152}
    assert "sysctl -w net.core.somaxconn=1152" in check.advice
    path.write_text("4096\n")
    assert doctor.check_somaxconn(Config(), str(path)).status == "ok"


def test_token_file_open_to_others_fails(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("s" * 32)
    token.chmod(0o644)
    monkeypatch.delenv("RLINK_TOKEN", raising=False)
    monkeypatch.setenv("RLINK_TOKEN_FILE", str(token))
    config = Config(token_dir=str(tmp_path / "dir"))
    check = doctor.check_token(config)
    assert check.status == "fail" and "chmod 600" in check.summary
    assert check.data["token_file_mode"]["mode"] == "0644" and check.data["token_file_mode"]["private"] is False
    token.chmod(0o600)
    check = doctor.check_token(config)
    assert check.status == "ok" and check.data["source"] == "RLINK_TOKEN_FILE"
    assert "s" * 32 not in repr(check.as_dict())  # the secret itself is never reported


def test_short_token_fails_and_an_open_token_directory_warns(tmp_path, monkeypatch):
    monkeypatch.delenv("RLINK_TOKEN_FILE", raising=False)
    monkeypatch.setenv("RLINK_TOKEN", "short")
    assert doctor.check_token(Config(token_dir=str(tmp_path))).status == "fail"
    monkeypatch.delenv("RLINK_TOKEN")
    directory = tmp_path / "tokens"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    check = doctor.check_token(Config(token_dir=str(directory)))
    assert check.status == "warn" and "not private" in check.summary
    directory.chmod(0o700)
    (directory / "8443.token").write_text("t" * 43)
    (directory / "8443.token").chmod(0o640)
    check = doctor.check_token(Config(token_dir=str(directory)))
    assert check.status == "warn" and "8443.token" in check.summary
    (directory / "8443.token").chmod(0o600)
    check = doctor.check_token(Config(token_dir=str(directory)))
    assert check.status == "ok" and check.data["generated_tokens"][0]["file"] == "8443.token"


@pytest.mark.parametrize("statuses,expected", [(["ok", "skip"], "ok"), (["ok", "warn", "skip"], "warn"),
                                               (["warn", "fail", "ok"], "fail"), ([], "ok")])  # fmt: skip
def test_worst_status(statuses, expected):
    assert doctor.worst([doctor.Check(str(i), s, "") for i, s in enumerate(statuses)]) == expected


@pytest.mark.timeout(30)
def test_without_ucxx_the_advice_names_the_cpu_and_cuda_extras_and_the_table_shows_them(monkeypatch):
    import importlib.util
    import io

    from rlink_ucx.doctor import remote as doctor_learner

    real = importlib.util.find_spec
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a))
    check = doctor.check_ucxx(Config())
    assert check.data["installed"] is False
    assert "pip install 'rlink-ucx[ucx]' (CPU) or 'rlink-ucx[cu12]' / 'rlink-ucx[cu13]'" in check.advice
    out = io.StringIO()  # rich, where installed, must show brackets as text, not take them for markup
    doctor_learner.render([doctor.Check("ucxx", "ok", "[ucx] extra", "pip install 'rlink-ucx[cu12]'")], out)
    assert "[ucx] extra" in out.getvalue() and "pip install 'rlink-ucx[cu12]'" in out.getvalue(), out.getvalue()

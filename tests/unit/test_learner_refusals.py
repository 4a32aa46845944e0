"""What a Learner refuses at construction, before anything is started, and what it says to do
(no network: each refusal comes before the learner binds)."""

from __future__ import annotations

import threading

import pytest

from rlink_ucx import ConfigError, Learner
from rlink_ucx.transport.ucx import plane as ucx_plane


@pytest.fixture
def no_token_env(monkeypatch):
    for name in ("RLINK_TOKEN", "RLINK_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "rlink-learner-io"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("address", ["127.0.0.1:0", "ucx://127.0.0.1:0"])
def test_transport_ucx_without_ucxx_is_refused_at_construction_with_the_install_hint(no_token_env, address):
    no_token_env.setattr(ucx_plane, "ucx_available", lambda: False)  # as if ucxx were not installed
    before = io_threads()
    transport = "ucx" if address.startswith("127") else "auto"
    with pytest.raises(ConfigError, match=r"transport='ucx', but ucxx is not installed") as info:
        Learner(address, transport=transport, insecure=True)
    message = str(info.value)
    assert "pip install 'rlink-ucx[ucx]' (CPU)" in message and "'rlink-ucx[cu12]'" in message
    assert io_threads() == before  # nothing was started


@pytest.mark.timeout(30)
def test_transport_ucx_after_ucx_failed_in_this_process_says_why(no_token_env):
    no_token_env.setattr(ucx_plane, "ucx_available", lambda: False)
    no_token_env.setattr(ucx_plane, "ucx_failure", lambda: "UCX did not start (bad UCX_TLS)")
    with pytest.raises(ConfigError, match=r"UCX already failed to start in this process: UCX did not start"):
        Learner("127.0.0.1:0", transport="ucx", insecure=True)


@pytest.mark.timeout(30)
def test_a_non_loopback_bind_without_a_token_names_the_python_cli_and_env_ways(no_token_env):
    with pytest.raises(ConfigError, match="without a token") as info:
        Learner("0.0.0.0:0")
    message = str(info.value)
    for way in ("token=", "--token-file", "RLINK_TOKEN_FILE", "rlink token --file"):
        assert way in message, way
    assert "insecure" not in message
    with pytest.raises(ConfigError, match="without a token") as info:
        Learner("0.0.0.0:0", insecure=True)
    assert "insecure=True (--insecure) works on loopback addresses only, not '0.0.0.0'" in str(info.value)

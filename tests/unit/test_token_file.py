"""Tokens without the network: the length rule, token files, the generated token's directory
and file checks, and the admission caps that shed unauthenticated connections."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from rlink_ucx import Config, ConfigError
from rlink_ucx.session import tokens as token_file
from rlink_ucx.session.tokens import check_token, read_token_file, resolve_token
from rlink_ucx.session.learner.admission import Admission, peer_key

NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RLINK_TOKEN", "RLINK_TOKEN_FILE", "RLINK_TOKEN_DIR", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_tokens_under_16_bytes_are_refused_and_the_error_says_how_to_make_one(clean_env):
    for short in ("", "x" * 15, b"\x00" * 15):
        with pytest.raises(ConfigError, match=r"at least 16 bytes.*rlink token"):
            check_token(short)
    assert check_token("x" * 16) == b"x" * 16
    assert check_token(os.urandom(16).hex()) and check_token(b"\xff" * 16) == b"\xff" * 16
    clean_env.setenv("RLINK_TOKEN", "too-short")
    with pytest.raises(ConfigError, match="RLINK_TOKEN is 9 bytes long"):
        resolve_token(None)
    assert resolve_token("given-explicitly-and-long") == b"given-explicitly-and-long"  # the argument wins


def test_token_files_must_exist_be_private_and_hold_a_long_token(clean_env, tmp_path):
    path = tmp_path / "token"
    clean_env.setenv("RLINK_TOKEN_FILE", str(path))
    with pytest.raises(ConfigError, match="cannot read the token file"):
        resolve_token(None)
    path.write_text("  a-token-read-from-a-file \n")
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_token(None)
    path.chmod(0o600)
    assert resolve_token(None) == b"a-token-read-from-a-file"
    path.write_text("short\n")
    with pytest.raises(ConfigError, match=r"the token in .* is 5 bytes long"):
        read_token_file(str(path))


def test_the_token_directory_is_xdg_runtime_dir_when_private_else_a_per_uid_one(clean_env, tmp_path):
    assert token_file.token_dir(Config()) == Path(f"/tmp/rlink-{os.geteuid()}")
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    clean_env.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert token_file.token_dir(Config()) == runtime / "rlink"
    runtime.chmod(0o755)  # not a real runtime directory: not trusted
    assert token_file.token_dir(Config()) == Path(f"/tmp/rlink-{os.geteuid()}")
    assert token_file.token_dir(Config(token_dir=str(tmp_path / "mine"))) == tmp_path / "mine"
    clean_env.setenv("RLINK_TOKEN_DIR", str(tmp_path / "from-env"))
    assert token_file.token_dir(Config.from_env()) == tmp_path / "from-env"


def test_a_published_token_is_private_found_and_withdrawn_only_by_its_owner(tmp_path):
    config = Config(token_dir=str(tmp_path / "tokens"))
    token = token_file.new_token().encode()
    path = token_file.publish(config, 4242, token)
    assert path == tmp_path / "tokens" / "4242.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == ["4242.token"]  # no temporary file left behind
    assert token_file.find(config, 4242) == (token, str(path))
    found, why = token_file.find(config, 4243)
    assert found is None and "no token file" in why
    newer = token_file.new_token().encode()  # a newer learner on the same port replaced it
    token_file.publish(config, 4242, newer)
    token_file.withdraw(path, token)
    assert path.read_bytes().strip() == newer
    token_file.withdraw(path, newer)
    assert not path.exists()


def test_generated_tokens_are_long_and_distinct():
    tokens = {token_file.new_token() for _ in range(100)}
    assert len(tokens) == 100 and min(len(t) for t in tokens) >= 43


def test_a_token_file_open_to_others_or_a_link_is_not_used(tmp_path):
    config = Config(token_dir=str(tmp_path / "tokens"))
    path = token_file.publish(config, 1, b"t" * 43)
    path.chmod(0o644)
    found, why = token_file.find(config, 1)
    assert found is None and "open to group/others" in why
    target = tmp_path / "elsewhere"
    target.write_bytes(b"t" * 43)
    target.chmod(0o600)
    path.unlink()
    path.symlink_to(target)  # a planted link is never followed
    found, why = token_file.find(config, 1)
    assert found is None and str(path) in why


def test_an_open_token_directory_is_refused_by_the_learner_and_ignored_by_actors(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    config = Config(token_dir=str(shared))
    with pytest.raises(ConfigError, match=r"refusing to keep the learner's token.*open to group/others"):
        token_file.publish(config, 7, b"t" * 43)
    (shared / "7.token").write_bytes(b"t" * 43)  # planted by anyone who can write there
    found, why = token_file.find(config, 7)
    assert found is None and "open to group/others" in why


@ROOT_ONLY
def test_a_squatted_token_directory_of_another_user_is_refused(tmp_path):
    squatted = tmp_path / "squatted"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, NOBODY, NOBODY)  # pre-created by another user, private to them
    config = Config(token_dir=str(squatted))
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}"):
        token_file.publish(config, 7, b"t" * 43)
    assert os.listdir(squatted) == []
    found, why = token_file.find(config, 7)
    assert found is None and f"belongs to uid {NOBODY}" in why


def test_write_new_makes_a_0600_file_whatever_the_umask_and_never_overwrites(tmp_path):
    path = tmp_path / "t"
    old = os.umask(0)
    try:
        token_file.write_new(str(path), "a-brand-new-token-of-some-length")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token_file(str(path)) == b"a-brand-new-token-of-some-length"
    with pytest.raises(ConfigError, match="exists"):
        token_file.write_new(str(path), "another-token-another-token")
    assert read_token_file(str(path)) == b"a-brand-new-token-of-some-length"


def test_peers_are_counted_by_ipv4_address_and_ipv6_slash_64():
    assert peer_key("10.1.2.3") == "10.1.2.3" and peer_key("10.1.2.3") != peer_key("10.1.2.4")
    assert peer_key("2001:db8:1:2::1") == peer_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert peer_key("2001:db8:1:3::1") != peer_key("2001:db8:1:2::1")
    assert peer_key("::ffff:10.1.2.3") == "10.1.2.3"


def test_admission_sheds_a_flooding_peers_own_connections_first():
    async def scenario() -> tuple[list[bool], list[bool], Admission]:
        admission = Admission(Config(max_handshakes=8, max_handshakes_per_peer=3))
        never = asyncio.Event()
        honest = [asyncio.create_task(never.wait()) for _ in range(2)]
        for task in honest:
            admission.admit(task, "10.0.0.1")
        flood = [asyncio.create_task(never.wait()) for _ in range(50)]
        for task in flood:
            admission.admit(task, "10.0.0.2")
        await asyncio.sleep(0)  # let the cancellations land
        return [t.cancelled() for t in honest], [t.cancelled() for t in flood], admission

    honest, flood, admission = asyncio.run(scenario())
    assert honest == [False, False], "a flood from another address pushed out an honest handshake"
    # Young handshakes are kept (a host's own storm of actors must not churn itself): the
    # flooder's newcomers are refused, never another peer's handshake.
    assert flood == [False] * 3 + [True] * 47
    assert admission.shed == admission.shed_per_peer == 47 and admission.in_flight == 5


def test_at_the_per_peer_cap_an_old_handshake_goes_and_a_young_one_stays():
    async def scenario() -> tuple[list[bool], Admission]:
        admission = Admission(Config(max_handshakes=8, max_handshakes_per_peer=2, preauth_timeout=0.05))
        never = asyncio.Event()
        tasks = [asyncio.create_task(never.wait()) for _ in range(4)]
        admission.admit(tasks[0], "10.0.0.2")
        await asyncio.sleep(0.05)  # older than preauth_timeout / 2: a slowloris
        admission.admit(tasks[1], "10.0.0.2")
        admission.admit(tasks[2], "10.0.0.2")  # the old one goes for it
        admission.admit(tasks[3], "10.0.0.2")  # the two left are young: the newcomer is refused
        await asyncio.sleep(0)
        return [t.cancelled() for t in tasks], admission

    cancelled, admission = asyncio.run(scenario())
    assert cancelled == [True, False, False, True]
    assert admission.shed_per_peer == 2 and admission.in_flight == 2


@pytest.mark.timeout(30)
def test_a_given_token_ignores_surrounding_whitespace_like_a_token_file(clean_env, tmp_path):
    path = tmp_path / "token"
    token_file.write_new(str(path), "a-brand-new-token-of-some-length")  # as `rlink token --file`: a newline after
    read_raw = path.read_text()  # open(path).read(), as a newcomer would
    assert read_raw.endswith("\n")
    clean_env.setenv("RLINK_TOKEN_FILE", str(path))
    from_file = resolve_token(None)  # the other side's RLINK_TOKEN_FILE
    assert from_file == b"a-brand-new-token-of-some-length"
    assert resolve_token(read_raw) == resolve_token(read_raw.encode()) == from_file
    clean_env.delenv("RLINK_TOKEN_FILE")
    clean_env.setenv("RLINK_TOKEN", " a-brand-new-token-of-some-length\n")
    assert resolve_token(None) == from_file
    with pytest.raises(ConfigError, match="is 5 bytes long"):  # the length rule counts what is left
        resolve_token("  short        \n")


@pytest.mark.timeout(30)
def test_a_token_file_path_with_a_literal_tilde_is_expanded(clean_env, tmp_path):
    clean_env.setenv("HOME", str(tmp_path))
    token_file.write_new(str(tmp_path / ".rlink-token"), "a-brand-new-token-of-some-length")
    clean_env.setenv("RLINK_TOKEN_FILE", "~/.rlink-token")  # as compose, k8s or systemd pass it: unexpanded
    assert resolve_token(None) == b"a-brand-new-token-of-some-length"
    assert read_token_file("~/.rlink-token") == b"a-brand-new-token-of-some-length"
    with pytest.raises(ConfigError, match=f"cannot read the token file {tmp_path}/missing"):
        read_token_file("~/missing")


def test_rlink_token_file_makes_missing_private_parents_and_a_missing_file_says_how_to_make_one(clean_env, tmp_path):
    clean_env.setenv("HOME", str(tmp_path))
    token_file.write_new("~/.rlink/token", "a-brand-new-token-of-some-length")
    assert stat.S_IMODE((tmp_path / ".rlink").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / ".rlink" / "token").stat().st_mode) == 0o600
    assert read_token_file("~/.rlink/token") == b"a-brand-new-token-of-some-length"
    with pytest.raises(ConfigError, match=r"make one with `rlink token --file .*/elsewhere/token`"):
        read_token_file(str(tmp_path / "elsewhere" / "token"))

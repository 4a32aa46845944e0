"""Authentication by default, attacked: strangers and other Unix users against a learner given
no token, fake learners against a default actor, and the secrets on the command line. Real
learner and actor processes on loopback."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pwd
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rlink_ucx import Actor, AuthError, Config, ConfigError, Learner, RLinkDataset
from rlink_ucx.wire import messages as _wire
from tests.integration.security_procs import other_user, stranger_actor

SPAWN = mp.get_context("spawn")
ROOT = Path(__file__).resolve().parents[2]
STRONG = "an-explicit-token-of-32-bytes-xx"


@pytest.mark.timeout(60)
def test_the_generated_token_is_private_written_after_bind_and_removed_on_close(tmp_path):
    token_dir = tmp_path / "tokens"
    learner = Learner("127.0.0.1:0", transport="tcp", config=Config(token_dir=str(token_dir)))
    try:
        path = Path(learner.token_file)
        assert path == token_dir / f"{learner.port}.token"  # port 0 resolved to the real port
        st, dst = os.stat(path), os.stat(token_dir)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == os.geteuid()
        token = path.read_text().strip()
        assert len(token) >= 43  # 32 random bytes, urlsafe base64
        # The same user's actor in another process finds it and delivers.
        dataset = RLinkDataset(learner, batch_size=1)
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=stranger_actor, args=(learner.address, None, {"RLINK_TOKEN_DIR": str(token_dir)},
                                                          results))  # fmt: skip
        proc.start()
        assert results.get(timeout=60) == ("connected", 1)
        assert dataset.fetch(timeout=10)["x"].tolist() == [666]
        proc.join(10)
        assert token not in repr(learner.stats())
    finally:
        learner.close()
    assert not path.exists(), "the token file outlived its learner"
    # A given token, or insecure=True, writes nothing.
    with Learner("127.0.0.1:0", token=STRONG, config=Config(token_dir=str(token_dir))) as given:
        assert given.token_file is None and not (token_dir / f"{given.port}.token").exists()
    with Learner("127.0.0.1:0", insecure=True, config=Config(token_dir=str(token_dir))) as open_learner:
        assert open_learner.token_file is None and os.listdir(token_dir) == []


@pytest.mark.timeout(90)
def test_strangers_without_the_token_are_refused_by_the_default_learner(tmp_path):
    elsewhere = tmp_path / "another-users-tokens"  # an actor that cannot see the learner's file
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        dataset = RLinkDataset(learner, batch_size=1)
        results = SPAWN.Queue()
        for token, env in ((None, {"RLINK_TOKEN_DIR": str(elsewhere)}), ("a-wrong-token-of-enough-bytes", {})):
            proc = SPAWN.Process(target=stranger_actor, args=(learner.address, token, env, results))
            proc.start()
            kind, message = results.get(timeout=60)
            proc.join(10)
            assert kind == "AuthError", (token, message)
        # A raw client that skips the proof is told "auth" and never welcomed.
        host, port = learner.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            _wire.read_message(s, 512)
            s.sendall(_wire.encode(_wire.Login(_wire.PROTOCOL_VERSION, os.urandom(32), b"")))
            reply = _wire.read_message(s, 1 << 16)
        assert isinstance(reply, _wire.Error) and reply.kind == "auth", reply
        stats = learner.stats()
        with pytest.raises(Exception, match="timed out"):
            dataset.fetch(timeout=0.5)  # no step of theirs got in
    assert stats["connected_actors"] == 0 and stats["ended_actors"] == [], stats
    assert stats["auth_failures"] >= 2, stats


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_another_unix_user_can_neither_read_the_token_nor_connect():
    nobody = pwd.getpwnam("nobody")
    with Learner("127.0.0.1:0", transport="tcp") as learner:
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=other_user, args=(learner.address, learner.token_file, nobody.pw_uid,
                                                      nobody.pw_gid, results))  # fmt: skip
        proc.start()
        report = results.get(timeout=60)
        proc.join(10)
        stats = learner.stats()
    assert report["uid"] == str(nobody.pw_uid), report
    assert report["read"] == "PermissionError", report
    assert report["default"].startswith("AuthError") and "requires a token" in report["default"], report
    assert report["learner_dir"].startswith("AuthError") and "requires a token" in report["learner_dir"], report
    assert stats["connected_actors"] == 0 and stats["ended_actors"] == [], stats


class FakeLearner:
    """Squats a port and plays the learner without knowing the token: it sends a Challenge
    (``auth``: whether it claims to check tokens), answers a Login with a made-up Proof, and
    records every message an actor sends it."""

    def __init__(self, auth: bool):
        self.auth = auth
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.server.settimeout(20)
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                conn.sendall(_wire.encode(_wire.Challenge(_wire.PROTOCOL_VERSION, os.urandom(32), self.auth)))
                while True:
                    try:
                        msg = _wire.read_message(conn, 1 << 20)
                    except (EOFError, OSError, Exception):  # noqa: BLE001 - the actor hung up
                        break
                    self.received.append(type(msg).__name__)
                    if isinstance(msg, _wire.Login):
                        conn.sendall(_wire.encode(_wire.Proof(os.urandom(32))))

    def close(self) -> None:
        # close() alone does not wake a thread blocked in accept(): it sat out join's 5 s (every
        # test paid them). A shutdown makes that accept() fail at once.
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self.thread.join(5)
        assert not self.thread.is_alive(), "the fake learner still serves: what it received may grow"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("auth, token", [(False, None), (False, STRONG), (True, None), (True, STRONG)],
                         ids=["open-no-token", "open-with-token", "auth-no-token", "auth-bad-proof"])  # fmt: skip
def test_a_default_actor_refuses_a_fake_learner_and_sends_it_no_step(auth, token):
    fake = FakeLearner(auth)
    try:
        started = time.monotonic()
        with pytest.raises(AuthError):
            Actor(f"127.0.0.1:{fake.port}", token=token, transport="tcp", config=Config(connect_timeout=20))
        assert time.monotonic() - started < 10, "refused at once, not retried until connect_timeout"
        time.sleep(0.2)
    finally:
        fake.close()
    # Only a Login (the actor proves first, with a fresh nonce) may reach it, and the goodbye
    # of a closing actor; never a Hello, a schema or a step.
    assert "Hello" not in fake.received and "Propose" not in fake.received, fake.received
    assert [m for m in fake.received if m != "Bye"] == (["Login"] if auth and token else []), fake.received


@pytest.mark.timeout(60)
def test_an_actor_accepts_an_unauthenticated_learner_only_when_told_to():
    with Learner("127.0.0.1:0", transport="tcp", insecure=True) as learner:
        dataset = RLinkDataset(learner, batch_size=2)
        with pytest.raises(AuthError, match="does not authenticate"):
            Actor(learner.address, transport="tcp")
        with Actor(learner.address, transport="tcp", insecure=True) as actor:
            actor.put_many({"x": np.arange(2, dtype=np.int64)})
            actor.flush(10)
        assert dataset.fetch(timeout=10)["x"].tolist() == [0, 1]
    with pytest.raises(ConfigError, match="insecure=True"):
        Learner("127.0.0.1:0", token=STRONG, insecure=True)
    with pytest.raises(ConfigError, match="without a token"):
        Learner("0.0.0.0:0", insecure=True)  # no escape from the non-loopback rule


@pytest.mark.timeout(30)
def test_short_tokens_are_refused_with_a_way_to_make_one():
    for make in (lambda: Learner("127.0.0.1:0", token="short-secret"),
                 lambda: Actor("127.0.0.1:1", token=b"fifteen-bytes!!")):  # fmt: skip
        with pytest.raises(ConfigError, match=r"at least 16 bytes.*rlink token"):
            make()
    with Learner("127.0.0.1:0", token=os.urandom(16).hex()) as learner:  # a 16-byte secret as hex is fine
        assert learner.token_file is None


def _wait_line(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(needle):  # the printed line, not the log line that says it too
            return lines
    raise AssertionError(f"{needle!r} never came: {lines}")


@pytest.mark.timeout(90)
def test_the_cli_keeps_the_token_out_of_argv(tmp_path):
    secret = "cli-secret-" + os.urandom(16).hex()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLINK_TOKEN")}
    cmd = [sys.executable, "-m", "rlink_ucx", "learner", "--address", "127.0.0.1:0", "--seconds", "60"]
    refused = subprocess.run([*cmd, "--token", secret], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                             check=False)  # fmt: skip
    assert refused.returncode == 2 and "listening" not in refused.stdout
    assert "RLINK_TOKEN" in refused.stderr and "--token-file" in refused.stderr
    assert secret not in refused.stderr + refused.stdout
    path = tmp_path / "token"
    path.write_text(secret + "\n")
    path.chmod(0o644)
    loose = subprocess.run([*cmd, "--token-file", str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60, check=False)  # fmt: skip
    assert loose.returncode == 2 and "chmod 600" in loose.stderr, loose.stderr
    path.chmod(0o600)
    proc = subprocess.Popen([*cmd, "--token-file", str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        lines = _wait_line(proc, "listening on", 60)
        address = lines[-1].split("listening on", 1)[1].strip()
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            argv = fh.read()
        assert b"--token-file" in argv and secret.encode() not in argv
        with Actor(address, token=secret, transport="tcp") as actor:  # the file's token is the one in force
            actor.put({"x": np.int64(1)})
            actor.flush(10)
        with pytest.raises(AuthError):
            Actor(address, token="not-the-token-in-the-file", transport="tcp")
    finally:
        proc.terminate()
        proc.wait(30)


def test_rlink_token_prints_strong_distinct_tokens_and_writes_private_files(tmp_path, capsys):
    from rlink_ucx import cli

    tokens = []
    for _ in range(5):
        assert cli.main(["token"]) == 0
        tokens.append(capsys.readouterr().out.strip())
    assert len(set(tokens)) == 5
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert all(len(t) >= 43 and set(t) <= alphabet for t in tokens), tokens
    path = tmp_path / "learner.token"
    assert cli.main(["token", "--file", str(path)]) == 0
    written = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(written) >= 43 and written not in tokens
    assert written not in capsys.readouterr().out
    assert cli.main(["token", "--file", str(path)]) == 2  # never overwritten
    assert path.read_text().strip() == written and "exists" in capsys.readouterr().err



@pytest.mark.timeout(60)
def test_an_eavesdropper_who_saw_the_welcome_cannot_attach_a_data_connection():
    """The Welcome carries the session's ticket in clear. A data connection proven with the
    ticket alone (what someone on the path can compute) is refused; one proven with the
    session's key (token + ticket) attaches. The learner runs here, the raw actor too."""
    import hashlib
    import hmac

    from rlink_ucx.wire import auth as _auth
    from tests.integration.hostile import RawActor

    token = STRONG.encode()
    with Learner("127.0.0.1:0", token=token, transport="tcp") as learner:
        owner = RawActor(learner.address, token, timeout=10)
        welcome = owner.hello(pid=os.getpid(), transport="tcp")
        spy = RawActor(learner.address, None, timeout=10)  # only its data connection is used
        spy.welcome = welcome
        data = spy.attach(key=welcome.ticket)  # the proof the ticket alone gives
        try:
            reply = _wire.read_message(data, 1 << 16)
        except (EOFError, ConnectionError) as exc:
            reply = exc
        assert (isinstance(reply, _wire.Error) and reply.kind == "auth") or isinstance(reply, (EOFError, ConnectionError)), reply
        data.close()
        with pytest.raises((socket.timeout, TimeoutError)):  # the owner hears nothing of it
            owner.control.settimeout(0.5)
            _wire.read_message(owner.control, 1 << 16)
        owner.control.settimeout(10)
        owner.attach()  # with the session's key
        proof = owner.expect(_wire.AttachProof)
        assert len(proof.mac) == 32
        assert owner.expect(_wire.Ready).transport == "tcp"
        # The old proof (HMAC keyed with the ticket) and the new one differ for the same nonce.
        nonce = os.urandom(32)
        old = hmac.new(welcome.ticket, b"rlink-v1 data|" + nonce + b"|" + str(welcome.session).encode(),
                       hashlib.sha256).digest()  # fmt: skip
        assert old != _auth.data_proof(owner.session_key, nonce, welcome.session)
        owner.close()
        spy.control.close()
        assert learner.stats()["auth_failures"] >= 1

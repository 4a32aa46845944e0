"""Child processes for the authentication tests: an actor that times its connection, strangers
with other credentials, and another Unix user. Each reports what happened through a queue."""

from __future__ import annotations

import os
import time

import numpy as np


def timed_actor(address: str, n: int, results) -> None:
    """Connect (timed), put ``n`` int64 steps and flush (timed): ("ok", connect_s, deliver_s)."""
    from rlink_ucx import Actor, Config

    started = time.monotonic()
    try:
        with Actor(address, transport="tcp", config=Config(connect_timeout=30)) as actor:
            connected = time.monotonic() - started
            actor.put_many({"x": np.arange(n, dtype=np.int64)})
            actor.flush(30)
            results.put(("ok", connected, time.monotonic() - started - connected))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        results.put((type(exc).__name__, str(exc), 0.0))


def stranger_actor(address: str, token: str | None, env: dict[str, str], results) -> None:
    """An actor with other credentials (``token``; ``env``: ``RLINK_*`` settings, such as
    another ``RLINK_TOKEN_DIR``): report ("connected", steps put) or (error type, message)."""
    from rlink_ucx import Actor

    os.environ.update({"RLINK_CONNECT_TIMEOUT": "10", **env})
    try:
        with Actor(address, token=token, transport="tcp") as actor:
            actor.put({"x": np.int64(666)})
            actor.flush(10)
            results.put(("connected", 1))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        results.put((type(exc).__name__, str(exc)))


def other_user(address: str, token_path: str, uid: int, gid: int, results) -> None:
    """Become ``uid``/``gid`` (the test runs as root), then try to read the learner's token file
    and to connect without a token: report what each attempt met."""
    from rlink_ucx import Actor  # everything is imported before the privileges go
    from rlink_ucx.errors import AuthError

    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    report: dict[str, str] = {"uid": str(os.geteuid())}
    try:
        with open(token_path, "rb") as fh:
            report["read"] = f"read {len(fh.read())} bytes"
    except OSError as exc:
        report["read"] = type(exc).__name__
    os.environ["RLINK_CONNECT_TIMEOUT"] = "10"
    for name, token_dir in (("default", None), ("learner_dir", os.path.dirname(token_path))):
        if token_dir is not None:  # where the learner wrote it
            os.environ["RLINK_TOKEN_DIR"] = token_dir
        try:
            with Actor(address, transport="tcp") as actor:
                actor.put({"x": np.int64(666)})
                actor.flush(10)
            report[name] = "connected"
        except AuthError as exc:
            report[name] = f"AuthError: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            report[name] = f"{type(exc).__name__}: {exc}"
    results.put(report)

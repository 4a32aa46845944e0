"""Code that runs in the spawned processes of test_live_fuzz.py: numpy and rlink_ucx only, so
a child does not import torch and pytest, as one unpickling a function of the test module did."""

from __future__ import annotations

import collections
import os
import random
import socket
import time
from typing import Any

import numpy as np

from rlink_ucx import Actor, RLinkError

TOKEN = b"live-fuzz-test-token-0123456789"
STAGES = ("preauth", "authenticated", "session", "data")


def _one_connection(host: str, port: int, stage: str, rng: random.Random) -> str:
    from rlink_ucx.wire import auth as _auth
    from rlink_ucx.wire import keys as _keys
    from rlink_ucx.wire import messages as _wire
    from tests import fuzzing as fz

    socks = []
    try:
        control = socket.create_connection((host, port), timeout=2)
        socks.append(control)
        challenge = _wire.read_message(control, 512)
        if stage == "preauth":
            control.sendall(fz.hostile_stream(rng, fz.PREAUTH_TYPES))
        else:
            nonce = _auth.new_nonce()
            control.sendall(_wire.encode(_wire.Login(fz.PV, nonce, _auth.actor_proof(TOKEN, challenge.nonce, nonce))))
            assert isinstance(_wire.read_message(control, 1 << 16), _wire.Proof)
            if stage == "authenticated":
                control.sendall(fz.hostile_stream(rng, fz.HELLO_TYPES))
            else:
                hello = _wire.Hello(None, 0, "0", "tcp", False, "fuzz-host", os.getpid())
                control.sendall(_wire.encode(hello))
                welcome = _wire.read_message(control, 1 << 20)
                assert isinstance(welcome, _wire.Welcome), welcome
                if stage == "session":
                    control.sendall(fz.hostile_stream(rng, fz.SESSION_TYPES))
                else:  # a data connection with a valid proof, then hostile frames
                    data = socket.create_connection((host, port), timeout=2)
                    socks.append(data)
                    ch = _wire.read_message(data, 512)
                    proof = _auth.data_proof(_keys.session_key(TOKEN, welcome.ticket, welcome.session), ch.nonce, welcome.session)
                    data.sendall(_wire.encode(_wire.Attach(fz.PV, welcome.session, proof)))
                    data.sendall(b"".join(fz.hostile_header(rng) + fz._bytes(rng, rng.randrange(0, 256))
                                          for _ in range(rng.randrange(1, 4))))  # fmt: skip
        for sock in socks:
            sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 2
        for sock in socks:  # read until the learner closes (it must not wait for more)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            while sock.recv(65536):
                pass
        return stage
    except TimeoutError:
        return f"{stage}: learner kept the connection open"
    except (OSError, EOFError, AssertionError, ValueError, RLinkError) as exc:
        # RLinkError: a refusal the learner may answer a Hello with (two fuzzed sessions of
        # this process raced for its actor id on a busy machine): an outcome, not a fault.
        return f"{stage}: {type(exc).__name__}"
    finally:
        for sock in socks:
            sock.close()


def fuzz_client_proc(address: str, seconds: float, seed: int, out: Any) -> None:
    """Fresh connections for ``seconds``, each at one stage with hostile input; reports counts."""
    host, port = address.rsplit(":", 1)
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        counts[_one_connection(host, int(port), rng.choice(STAGES), rng)] += 1
    out.put(dict(counts))


def steady_proc(address: str, actor_id: int, n: int, out: Any) -> None:
    with Actor(address, token=TOKEN, transport="tcp", actor_id=actor_id) as actor:
        for start in range(0, n, 100):
            actor.put_many({"x": np.arange(start, start + 100, dtype=np.int64)})
        actor.flush(60)
    out.put(n)

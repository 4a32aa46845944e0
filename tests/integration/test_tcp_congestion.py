"""``Config.tcp_congestion`` reaches both ends of a real tcp-plane data connection."""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CONGESTION is Linux-only")]


def _congestion(sock: socket.socket) -> bytes:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")


def _default() -> bytes:
    with socket.socket() as sock:
        return _congestion(sock)


@pytest.mark.parametrize(("setting", "expected"), [("auto", b"reno"), ("system", None), ("reno", b"reno")])
def test_both_ends_of_the_data_connection_follow_the_setting(setting, expected):
    config = Config(tcp_congestion=setting)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        with Actor(learner.address, transport="tcp", config=config) as actor:
            actor.put({"x": np.arange(4, dtype=np.float32)})
            actor.flush(10)
            (session,) = learner._server.sessions.values()
            ends = [_congestion(actor._conn.sender.sock), _congestion(session.receiver.sock)]
    assert ends == [expected or _default()] * 2

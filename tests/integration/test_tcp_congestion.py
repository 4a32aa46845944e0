"""``Config.tcp_congestion`` reaches both ends of a real tcp-plane data connection."""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest

from rlink_ucx import Actor, Config, Learner
from rlink_ucx.transport.sockopts import congestion_of

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CONGESTION is Linux-only")]



def _default() -> str:
    with socket.socket() as sock:
        return congestion_of(sock)


@pytest.mark.parametrize(("setting", "expected"), [("auto", "reno"), ("system", None), ("reno", "reno")])
def test_both_ends_of_the_data_connection_follow_the_setting(setting, expected):
    config = Config(tcp_congestion=setting)
    with Learner("127.0.0.1:0", transport="tcp", config=config) as learner:
        with Actor(learner.address, transport="tcp", config=config) as actor:
            actor.put({"x": np.arange(4, dtype=np.float32)})
            actor.flush(10)
            (session,) = learner._server.sessions.values()
            ends = [congestion_of(actor._conn.sender.sock), congestion_of(session.receiver.sock)]
    assert ends == [expected or _default()] * 2

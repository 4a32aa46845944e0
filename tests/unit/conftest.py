"""Fixtures shared by the unit tests."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from rlink_ucx import Config
from rlink_ucx.weights.publisher import Publisher


@pytest.fixture
def connection():
    """A real loopback TCP connection: ``(actor_side, learner_side)``, closed afterwards."""
    server = socket.create_server(("127.0.0.1", 0))
    actor_side = socket.create_connection(server.getsockname())
    learner_side, _ = server.accept()
    server.close()
    yield actor_side, learner_side
    actor_side.close()
    learner_side.close()


@pytest.fixture
def paced_connection(connection):
    """``connection`` with both ends on a congestion control other than Reno where the kernel
    has one (BBR or CUBIC), so a test that expects rlink to choose Reno can fail."""
    for sock in connection:
        for name in (b"bbr", b"cubic"):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name)
                break
            except (OSError, AttributeError):  # (TCP_CONGESTION is Linux-only)
                pass
    return connection


@pytest.fixture
def publisher():
    """A learner's weights publisher with no server behind it (no sessions, no sockets)."""
    loop = asyncio.new_event_loop()
    owner = SimpleNamespace(config=Config(), loop=loop, host="127.0.0.1", token=b"t" * 32, version=0, sessions={})
    pub = Publisher(owner)
    yield pub
    pub.close()
    loop.close()

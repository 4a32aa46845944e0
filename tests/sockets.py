"""Socket helpers the tests share."""

from __future__ import annotations

import socket


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (reads what is pending; leaves it non-blocking)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def ipv6_loopback() -> bool:
    """Whether this machine can listen on ``::1``."""
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False

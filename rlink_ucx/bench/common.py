"""Small helpers the harness's modules share."""

from __future__ import annotations

import importlib.util
import os
import socket

BATCH_BYTES = 4 << 20  # the learner's batches of the rlink rows: about this many bytes
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds rlink_ucx/


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from a blocking socket; EOFError if the peer closes first."""
    while view:
        n = sock.recv_into(view)
        if not n:
            raise EOFError("connection closed mid-message")
        view = view[n:]

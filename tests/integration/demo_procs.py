"""Code for spawned processes of the demo tests (importable by the children)."""

from __future__ import annotations

from typing import Any


def spin_until_stopped(stop: Any) -> None:
    """Ask ``stop`` as fast as possible until it is set (a demo actor asks once per unroll)."""
    while not stop.is_set():
        pass

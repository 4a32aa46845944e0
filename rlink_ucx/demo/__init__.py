"""``rlink demo``: PPO on a Gymnasium env with actor processes streaming through rlink."""

from .run import main

__all__ = ["main"]

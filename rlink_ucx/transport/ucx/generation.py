"""The learner's UCX workers, one generation at a time: a worker keeps the shared memory of
every actor process it talked to, dead or alive, for as long as it lives, so the ``ucx`` plane
(``learner.py``) starts a fresh one after enough ended sessions and retires the old one once its
sessions are gone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .setup import load_ucxx, make_worker
from .unexpected import Sweeper

if TYPE_CHECKING:
    from ...config import Config


def recycle_due(ended: int, live: int, after: int) -> bool:
    """Should a worker with ``ended`` ended and ``live`` live sessions be recycled?

    Recycling makes every live ucx actor reconnect once, so it waits for ``after`` ended
    sessions and at least twice as many as are live: the stale memory stays within about twice
    what the live actors hold, and an ended session costs at most half a reconnect. ``after``
    0 means never.
    """
    return after > 0 and ended >= max(after, 2 * live)


class Generation:
    """One UCX worker of the learner plane. A worker keeps the shared memory of every peer
    process it has talked to, dead or alive, for as long as it lives; so after enough ended
    sessions the plane starts a new generation and retires this one once its sessions are gone."""

    def __init__(self, config: Config, loopback: bool, devices: list[str] | None):
        self.u, self.context, self.worker = make_worker(config, loopback, devices)
        self.address = bytes(self.worker.address.tobytes())
        self.worker.init_blocking_progress_mode()  # the plane sleeps in its epoll when idle
        self.ended = 0  # sessions of this worker that have ended
        self.sweeper: Sweeper | None = Sweeper(self.u, load_ucxx()[1])

    def release(self) -> None:
        """Destroy the worker (on the progress thread, which made it): its mappings go with it."""
        self.worker = self.context = self.sweeper = None

"""Who may touch the replay's rows outside its lock: the insert/sample coordination counters
together with the one condition that guards the whole replay core (table, sampler, limiter).

An insert copies step bytes without the lock, and so does a sample gathering rows. Three rules
keep them apart: no insert starts while a checkpoint save holds the replay paused; an insert that
must evict waits until no gather is copying (an evicted row may be overwritten at once), and
while it waits no new sample starts (or the gathers might never all end); a save waits for an
insert in flight to finish before it snapshots.
"""

from __future__ import annotations

import threading

__all__ = ["InsertGate"]


class InsertGate:
    """The replay's condition and the counters of what runs outside it. Methods marked "lock
    held" are called inside ``with gate.cond``; the others take it themselves."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.paused = 0  # saves in progress: no insert while > 0
        self.inserting = False  # an insert is copying outside the lock
        self.gathering = 0  # samples copying rows outside the lock
        self.evicting = 0  # inserts waiting for those copies to finish before they evict

    # --- the inserter ------------------------------------------------------------------------
    def wait_to_insert(self, evicts: bool) -> None:
        """Wait until an insert may go on (lock held): no save paused it and, if it ``evicts``,
        no gather is copying."""
        while True:
            while self.paused:  # a save began after wait_room said yes: its snapshot comes first
                self.cond.wait()
            if not (evicts and self.gathering):
                break
            # Keep new gathers from starting meanwhile, then look again: a save may have begun
            # while we waited.
            self.evicting += 1
            try:
                while self.gathering:
                    self.cond.wait()
            finally:
                self.evicting -= 1

    def begin_insert(self) -> None:
        """The insert copies outside the lock from now until :meth:`end_insert` (lock held)."""
        self.inserting = True

    def end_insert(self) -> None:
        """The insert's copies are done (lock held; the caller notifies once it published)."""
        self.inserting = False

    # --- samples -----------------------------------------------------------------------------
    def may_sample(self) -> bool:
        """Whether a sample may pick rows now (lock held): not while an insert waits to evict."""
        return not self.evicting

    def begin_gather(self) -> None:
        """A sample starts copying rows outside the lock (lock held)."""
        self.gathering += 1

    def end_gather(self) -> None:
        """A sample's copy ended (lock held); wakes an insert waiting for the last one."""
        self.gathering -= 1
        if self.evicting and not self.gathering:
            self.cond.notify_all()

    # --- a checkpoint save -------------------------------------------------------------------
    def pause(self) -> None:
        """Stop inserts (they wait, and so do the actors) and wait for one in flight."""
        with self.cond:
            self.paused += 1
            while self.inserting:
                self.cond.wait()

    def resume(self) -> None:
        """Undo one :meth:`pause`."""
        with self.cond:
            self.paused -= 1
            self.cond.notify_all()

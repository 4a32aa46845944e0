"""The samples-per-insert rate limiter, with Reverb's ``SampleToInsertRatio`` semantics.

With ``samples_per_insert = s``, ``min_size = m`` and ``tolerance = e`` (in samples), the
quantity ``diff = s * inserted - sampled`` is kept within ``[s*m - e, s*m + e]``:

- a sample of ``k`` items may go once at least ``m`` items are held and while
  ``diff - k >= s*m - e`` (else the sampler waits for inserts);
- an insert of ``k`` steps may go while the table holds fewer than ``m`` items, or while
  ``diff + s*k <= s*m + e`` (else the inserter waits for samples: it stops taking steps
  from the learner's ring, so the learner stops granting credit and the actors slow down).

Without ``s`` only the minimum size applies. The limiter keeps counters only; the caller holds
the lock that guards them together with the table (see ``ReplayCore``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError

__all__ = ["RateLimiter"]


@dataclass
class RateLimiter:
    min_size: int = 1
    samples_per_insert: float | None = None
    tolerance: float = 0.0
    inserted: int = 0  # steps ever inserted
    sampled: int = 0  # items ever handed out (steps, or windows with sequences)

    @classmethod
    def create(cls, min_size: int, samples_per_insert: float | None, tolerance: float | None,
               sample_items: int) -> RateLimiter:  # fmt: skip
        """Validate the settings; ``sample_items`` is what one ``sample()`` counts (B)."""
        if min_size < 1:
            raise ConfigError("min_size must be >= 1")
        if samples_per_insert is None:
            if tolerance is not None:
                raise ConfigError("spi_tolerance needs samples_per_insert")
            return cls(min_size)
        s = float(samples_per_insert)
        if not s > 0 or not math.isfinite(s):
            raise ConfigError(f"samples_per_insert must be a positive number, got {samples_per_insert!r}")
        e = float(sample_items + s) if tolerance is None else float(tolerance)
        # Both sides blocked at once would be a deadlock: a sample of B needs diff >= s*m - e + B,
        # an insert of one step needs diff <= s*m + e - s, so the band must fit B + s.
        if not 2 * e >= sample_items + s:
            raise ConfigError(
                f"spi_tolerance {e:g} is too small: the band s*min_size +- e must be at least "
                f"batch_size + samples_per_insert = {sample_items + s:g} wide (2e), or sampling and "
                "inserting could both block for good"
            )
        return cls(min_size, s, e)

    # ``held``: items in the table now (inserted minus evicted).
    def can_sample(self, k: int, held: int) -> bool:
        if held < self.min_size:
            return False
        if self.samples_per_insert is None:
            return True
        return self._diff() - k >= self._center() - self.tolerance

    def insert_room(self, held: int) -> int | None:
        """How many steps may be inserted now (None: no limit)."""
        room = max(0, self.min_size - held)  # below the minimum size an insert always goes
        if self.samples_per_insert is None:
            return None
        s = self.samples_per_insert
        band = math.floor((self._center() + self.tolerance - self._diff()) / s + 1e-9)
        return max(room, band)

    def _diff(self) -> float:
        return (self.samples_per_insert or 0.0) * self.inserted - self.sampled

    def _center(self) -> float:
        return (self.samples_per_insert or 0.0) * self.min_size

    def state(self) -> dict[str, Any]:
        return {"min_size": self.min_size, "samples_per_insert": self.samples_per_insert,
                "tolerance": self.tolerance, "inserted": self.inserted, "sampled": self.sampled}  # fmt: skip

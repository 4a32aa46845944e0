"""The samples-per-insert rate limiter: Reverb's band, blocking samples, held-back inserts."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rlink_ucx import ConfigError, ReplayDataset
from rlink_ucx import TimeoutError as RLinkTimeout
from rlink_ucx.store.replay.limiter import RateLimiter
from tests.unit.replay_helpers import FakeLearner, new_ring, put, wait_for


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spi,e,b", [(4.0, 40.0, 8), (0.5, 10.0, 16), (8.0, 12.0, 16)])
def test_random_interleavings_keep_diff_inside_the_band(spi, e, b):
    m = 20
    lim = RateLimiter.create(m, spi, e, b)
    rng = np.random.default_rng(0)
    held = 0
    for _ in range(20_000):
        if rng.random() < 0.5:
            room = lim.insert_room(held)
            k = int(rng.integers(1, 5))
            if room is not None and k > room:
                k = room
            lim.inserted += k
            held = min(held + k, 1000)
        elif lim.can_sample(b, held):
            lim.sampled += b
        if held >= m:  # the band holds once sampling may start (Reverb: inserts below m are free)
            diff = spi * lim.inserted - lim.sampled
            assert spi * m - e <= diff <= spi * m + e, (diff, lim)
    assert lim.sampled > 1000  # both sides made progress


@pytest.mark.timeout(30)
def test_band_edges_are_exact():
    lim = RateLimiter.create(min_size=10, samples_per_insert=2.0, tolerance=6.0, sample_items=4)
    # center s*m = 20, band [14, 26]; an empty table takes max(m, (20 + 6) / 2) inserts
    assert lim.insert_room(0) == 13
    lim.inserted = 10
    assert not lim.can_sample(4, held=9)  # below min_size
    assert lim.can_sample(4, held=10)  # diff 20 - 4 = 16 >= 20 - 6
    lim.sampled = 4
    assert not lim.can_sample(4, 10)  # 16 - 4 = 12 < 14
    lim.sampled = 12
    assert not lim.can_sample(4, 10)  # diff 8 - 4 = 4 < 14
    assert lim.insert_room(10) == 9  # (20 + 6 - (20 - 12)) / 2
    with pytest.raises(ConfigError, match="too small"):
        RateLimiter.create(10, 2.0, 2.0, 4)  # 2e = 4 < 4 + 2: both sides could block
    with pytest.raises(ConfigError):
        RateLimiter.create(10, None, 3.0, 4)


@pytest.mark.timeout(60)
def test_inserts_are_held_back_in_the_ring_and_released_by_samples():
    ring = new_ring(steps=4096)
    s, m, b = 1.0, 100, 10
    with ReplayDataset(FakeLearner(ring), capacity=10_000, batch_size=b, samples_per_insert=s, min_size=m,
                       spi_tolerance=20) as r:  # fmt: skip
        put(ring, 1, 0, 1000, frame=10)
        assert wait_for(lambda: r.inserted == 120)  # m + e/s: diff = 120 - 0 <= 100 + 20
        time.sleep(0.2)
        assert r.inserted == 120 and ring.ready_steps() == 880  # held back in the ring, not dropped
        for _ in range(30):  # each sample of 10 makes room for 10 inserts
            r.sample(5)
        assert wait_for(lambda: r.inserted == 420)
        assert ring.ready_steps() == 580
        diff = s * r.inserted - r.sampled
        assert m - 20 <= diff <= m + 20


@pytest.mark.timeout(60)
def test_sample_waits_for_inserts_then_raises_the_library_timeout():
    ring = new_ring()
    with ReplayDataset(FakeLearner(ring), capacity=1000, batch_size=10, samples_per_insert=0.5, min_size=20,
                       spi_tolerance=15) as r:  # fmt: skip
        put(ring, 1, 0, 40)
        assert wait_for(lambda: r.inserted == 40)
        r.sample(5)
        r.sample(5)  # diff 20 - 20 = 0; the next needs 0 - 10 >= 10 - 15: no
        started = time.monotonic()
        with pytest.raises(RLinkTimeout, match="rate limiter"):
            r.sample(0.3)
        assert time.monotonic() - started >= 0.29
        got = []
        t = threading.Thread(target=lambda: got.append(r.sample(10)))
        t.start()
        time.sleep(0.2)
        assert not got  # still blocked
        put(ring, 1, 40, 20)  # diff 30 - 20 = 10: one more sample fits
        t.join(10)
        assert got and got[0].batch_size == 10

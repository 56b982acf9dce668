"""A short `cpcache bench soak`: the same four daemons (TP 4 x CP 2), the same
per-rank storage, copy and round faults, cancelled calls and one-rank
rejections, for a few hundred steps. Every step must agree byte for byte,
nothing may hang, and every page loaded back must hold the bytes written."""

import pytest

from cpcache.testing.soak import SoakConfig, soak

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(180)]


async def test_a_short_soak_agrees_everywhere_and_loads_exact_bytes(run_dir):
    cfg = SoakConfig(decisions=20_000, seed=3, votes_per_step=24, big_every=50, cancel_every=12, reject_every=15,
                     run_dir=run_dir)
    t = await soak(cfg)
    assert t.divergences == 0, t.first_errors
    assert t.hangs == 0, t.first_errors
    assert t.wrong_bytes == 0, t.first_errors
    assert t.wrong_decisions == 0, t.first_errors
    assert t.unexpected_errors == 0, t.first_errors
    assert t.ok
    assert t.decisions >= 20_000
    # The faults were injected and the cache was exercised.
    assert t.injected_rejections > 0 and t.cancelled_calls > 0 and t.cancelled_mid_round > 0
    assert t.cache.write_acks > 0 and t.cache.load_acks > 0 and t.loaded_pages_verified > 0
    assert t.cache.prefetches > 0 and t.max_votes_per_step >= 1024

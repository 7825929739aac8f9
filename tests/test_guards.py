"""SpikeGuard: non-finite detection, robust spike detection, window hygiene, state round trip."""

from __future__ import annotations

import math
import random

from dflash_cache.runtime.schema import GuardsConfig
from train.guards import SpikeGuard, robust_z


def _warm(guard: SpikeGuard, n: int = 32, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        loss, gn = 2.0 + rng.gauss(0, 0.05), 1.0 + rng.gauss(0, 0.1)
        guard.update(guard.check(loss, gn), loss, gn)


def test_nonfinite_is_skipped_even_without_history():
    g = SpikeGuard(GuardsConfig())
    assert g.check(math.nan, 1.0).reason == "nonfinite_loss"
    assert g.check(1.0, math.inf).reason == "nonfinite_grad"
    assert not g.check(1.0, 1.0).skip  # no history yet: only finiteness is judged


def test_spike_detected_and_not_added_to_window():
    g = SpikeGuard(GuardsConfig(window=64, min_history=16, z_threshold=6.0))
    _warm(g)
    n_before = len(g.grad_norms)
    v = g.check(2.0, 1e6)
    assert v.skip and v.reason == "grad_norm_spike" and v.grad_z > 6
    g.update(v, 2.0, 1e6)
    assert len(g.grad_norms) == n_before and max(g.grad_norms) < 10
    v = g.check(2e6, 1.0)
    assert v.skip and v.reason == "loss_spike"
    # normal values and downward excursions pass
    assert not g.check(2.02, 1.05).skip
    assert not g.check(0.1, 0.01).skip


def test_consecutive_skips_stop_and_reset():
    g = SpikeGuard(GuardsConfig(max_consecutive_skips=3))
    for _ in range(2):
        g.update(g.check(math.nan, 1.0), math.nan, 1.0)
    assert not g.should_stop
    g.update(g.check(1.0, 1.0), 1.0, 1.0)
    assert g.consecutive_skips == 0 and g.total_skips == 2
    for _ in range(3):
        g.update(g.check(math.nan, 1.0), math.nan, 1.0)
    assert g.should_stop


def test_state_round_trip_gives_same_decisions():
    cfg = GuardsConfig(window=16, min_history=8)
    a = SpikeGuard(cfg)
    _warm(a, n=40)
    b = SpikeGuard(cfg)
    b.load_state_dict(a.state_dict())
    assert list(b.grad_norms) == list(a.grad_norms) and len(b.grad_norms) == 16
    for x in (1.0, 1.5, 3.0, 50.0):
        assert a.check(2.0, x) == b.check(2.0, x)


def test_robust_z_and_min_ratio():
    z, med = robust_z(1.5, [1.0, 1.1, 0.9] * 10)
    assert med == 1.0 and math.isclose(z, 0.5 / (1.4826 * 0.1), rel_tol=1e-9)
    # far in sigmas but below min_ratio x median: a small batch's larger gradient, not an explosion
    g = SpikeGuard(GuardsConfig(min_history=4, min_ratio=5.0))
    _warm(g)
    assert not g.check(2.0, 4.0).skip
    assert g.check(2.0, 6.0).skip

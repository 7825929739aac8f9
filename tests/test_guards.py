"""SpikeGuard: non-finite detection, robust spike detection, window hygiene, state round trip."""

from __future__ import annotations

import json
import math
import random

import pytest
from fixtures.trainer import run_train, small_cache

from train.components.guards import SpikeGuard, robust_z
from train.components.metrics import read_metrics
from train.config import GuardsConfig


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


# --- synthetic norm/loss series through the guard: level shifts, isolated spikes, divergence -----------------


def _run_series(cfg: GuardsConfig, series: list[tuple[float, float]]) -> tuple[list[int], int | None, SpikeGuard]:
    """Feed (loss, grad_norm) per step (numbered from 1) as train_step does: ``(skipped steps, stop step, guard)``."""
    g = SpikeGuard(cfg)
    skipped = []
    for step, (loss, gn) in enumerate(series, start=1):
        v = g.check(loss, gn)
        g.update(v, loss, gn)
        if v.skip:
            skipped.append(step)
        if g.should_stop:
            return skipped, step, g
    return skipped, None, g


def _healthy(n: int, shift_at: int | None = None, factor: float = 1.0, seed: int = 0,
             flat: bool = False) -> list[tuple[float, float]]:
    """A falling loss (13.5 -> ~8; ``flat``: 5) with batch noise; the grad norm ~1 (10% noise), x``factor``
    from ``shift_at``."""
    rng = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        level = factor if shift_at is not None and step >= shift_at else 1.0
        loss = (5.0 if flat else 8.0 + 5.5 * math.exp(-step / 60)) + rng.gauss(0, 0.05)
        out.append((loss, level * (1.0 + rng.gauss(0, 0.1))))
    return out


@pytest.mark.parametrize("flat", [False, True], ids=["falling_loss", "flat_loss"])
@pytest.mark.parametrize("factor", [10.0, 20.0, 1000.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_level_shift_of_a_healthy_run_costs_at_most_rebaseline_after_skips(factor, seed, flat):
    # the demo's failure: the norm moved from ~1 to 15-22 at step 25 while the loss kept falling
    cfg = GuardsConfig()
    skipped, stop, g = _run_series(cfg, _healthy(200, shift_at=25, factor=factor, seed=seed, flat=flat))
    assert stop is None, f"stopped at step {stop} after skipping {skipped}"
    assert 1 <= len(skipped) <= cfg.rebaseline_after and all(s >= 25 for s in skipped)
    assert max(skipped) < 25 + 4 * cfg.rebaseline_after  # and training continues unskipped after it
    # x10 sits at guards.min_ratio: some steps pass and the window may catch up without a re-baseline
    assert g.rebaselines == 1 if factor > cfg.min_ratio else g.rebaselines <= 1


def test_isolated_spikes_are_exactly_the_skipped_steps():
    series = _healthy(150, seed=3)
    spikes = [40, 41, 90, 130]  # two adjacent adversarial batches, then two lone ones
    for s in spikes:
        series[s - 1] = (series[s - 1][0], 50.0 * series[s - 1][1])
    skipped, stop, g = _run_series(GuardsConfig(), series)
    assert skipped == spikes and stop is None and g.rebaselines == 0


def test_isolated_spikes_after_a_level_shift_are_still_skipped():
    cfg = GuardsConfig()
    series = _healthy(200, shift_at=25, factor=15.0, seed=4)
    spikes = [80, 120, 160]
    for s in spikes:
        series[s - 1] = (series[s - 1][0], 50.0 * series[s - 1][1])
    skipped, stop, g = _run_series(cfg, series)
    shift_skips = [s for s in skipped if s < 80]
    assert stop is None and len(shift_skips) <= cfg.rebaseline_after
    assert [s for s in skipped if s >= 80] == spikes and g.rebaselines == 1


def _diverge_from(series: list[tuple[float, float]], at: int, rate: float) -> list[tuple[float, float]]:
    """From step ``at`` on, the norm and the loss both grow by ``rate`` per step (a run blowing up)."""
    out = list(series)
    for step in range(at, len(series) + 1):
        k = step - at + 1
        loss, gn = series[step - 1]
        out[step - 1] = (loss * (1 + 0.02 * k), gn * rate ** k)
    return out


@pytest.mark.parametrize("rate", [1.15, 1.5, 3.0])
def test_divergence_after_a_level_shift_stops_within_a_bounded_number_of_steps(rate):
    cfg = GuardsConfig()
    series = _diverge_from(_healthy(300, shift_at=25, factor=15.0, seed=5), at=100, rate=rate)
    skipped, stop, g = _run_series(cfg, series)
    assert stop is not None and 100 <= stop <= 100 + 40, (stop, skipped)
    assert g.consecutive_skips == cfg.max_consecutive_skips
    assert g.last_refusal and "rising" in g.last_refusal


def test_jump_with_rising_loss_is_not_accepted_as_a_level_shift():
    cfg = GuardsConfig()
    series = _healthy(100, seed=6)
    for step in range(40, 101):  # norm x20 and the loss climbing back up (~2% a step): not a healthy shift
        loss, gn = series[step - 1]
        series[step - 1] = (loss + 0.25 * (step - 39), 20.0 * gn)
    skipped, stop, g = _run_series(cfg, series)
    assert stop == 40 + cfg.max_consecutive_skips - 1 and skipped == list(range(40, stop + 1))
    assert "loss is rising" in g.last_refusal and g.rebaselines == 0


def test_nonfinite_stream_stops_and_is_never_rebaselined():
    cfg = GuardsConfig()
    series = _healthy(60, seed=7)
    series[30:] = [(math.nan, 1.0)] * 30
    skipped, stop, g = _run_series(cfg, series)
    assert stop == 30 + cfg.max_consecutive_skips and g.rebaselines == 0


def _grow_from(series: list[tuple[float, float]], at: int, rate: float) -> list[tuple[float, float]]:
    """From step ``at`` on the norm grows by ``rate`` per step; the loss stays as it was."""
    return [(loss, gn * rate ** max(0, step - at + 1)) for step, (loss, gn) in enumerate(series, start=1)]


@pytest.mark.parametrize("rate", [1.05, 1.1, 1.15, 1.25, 1.5, 3.0])
def test_a_norm_growing_geometrically_under_a_flat_loss_stops_the_run(rate):
    """Only the norm says the run is blowing up here. From ~20% a step its rise across one set of spikes refuses
    the level shift; slower, the first shift may be accepted, and the next one up within guards.window steps is
    refused: the run stops instead of re-baselining while the norm climbs by orders of magnitude. (Under ~4% a
    step no step is ever a spike: the window follows the drift.)"""
    cfg = GuardsConfig()
    skipped, stop, g = _run_series(cfg, _grow_from(_healthy(400, seed=5, flat=True), at=40, rate=rate))
    assert stop is not None and stop <= 40 + 2 * cfg.window, (rate, skipped, g.rebaselines)
    assert g.consecutive_skips == cfg.max_consecutive_skips
    assert g.rebaselines == 0 if rate >= 1.2 else g.rebaselines <= 1, g.rebaselines
    assert g.last_refusal and "gradient norm is rising" in g.last_refusal, g.last_refusal


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_settling_overshoot_is_a_level_shift_within_rebaseline_after_skips(seed):
    """The norm jumps to ~75x at step 25 and settles to ~15x within a few steps (falling across the spikes, by
    more than guards.rebaseline_max_rise between their halves): one re-baseline after at most rebaseline_after
    skips, far inside the skip budget, and training goes on."""
    cfg = GuardsConfig()
    series = _healthy(200, seed=seed)
    series = [(loss, gn * (15.0 + 60.0 * math.exp(-(step - 25) / 3) if step >= 25 else 1.0))
              for step, (loss, gn) in enumerate(series, start=1)]
    skipped, stop, g = _run_series(cfg, series)
    assert stop is None and g.rebaselines == 1, (skipped, g.last_refusal)
    assert 1 <= len(skipped) <= cfg.rebaseline_after and all(25 <= s < 25 + 2 * cfg.rebaseline_after for s in skipped)


def test_rebaseline_zero_restores_the_strict_guard():
    cfg = GuardsConfig(rebaseline_after=0)
    skipped, stop, _ = _run_series(cfg, _healthy(200, shift_at=25, factor=20.0))
    assert stop == 25 + cfg.max_consecutive_skips - 1


def test_state_round_trip_mid_level_shift_gives_same_decisions():
    cfg = GuardsConfig()
    series = _healthy(120, shift_at=25, factor=20.0, seed=8)
    a, b = SpikeGuard(cfg), SpikeGuard(cfg)
    decisions_a, decisions_b = [], []
    for step, (loss, gn) in enumerate(series, start=1):
        if step == 29:  # four spikes into the shift: the checkpoint carries them
            b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        for g, out in ((a, decisions_a), (b, decisions_b)):
            if g is b and step < 29:
                continue
            v = g.check(loss, gn)
            g.update(v, loss, gn)
            out.append(v)
    assert decisions_a[28:] == decisions_b and a.rebaselines == b.rebaselines == 1


# --- through dflash-train: a lasting jump of the gradient norm is trained through; a stop says what to do ---

BASE = ["model.mask_token_id=511", "train.max_steps=30", "train.num_anchors=16", "guards.min_history=8",
        "metrics.tensorboard=false", "metrics.progress_bar=false"]
JUMP = json.dumps({"grad_scale_from": 14, "grad_scale": 40.0})  # the norm x40 from step 14, the loss untouched


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return small_cache(str(tmp_path_factory.mktemp("cache") / "cache"))


def test_trainer_stops_with_exit_3_on_a_norm_growing_geometrically_under_an_unchanged_loss(cache, tmp_path):
    """The gradient (not the logged loss) x1.5 a step from step 14: refused as a level shift ("rising"), and the
    run stops with exit code 3 instead of re-baselining."""
    run = tmp_path / "run"
    proc = run_train(BASE, cache, run, "train.max_steps=60", "checkpoint.every_steps=100", expect=3,
                     DFLASH_TEST_FAULTS=json.dumps({"grad_scale_from": 14, "grad_growth": 1.5}))
    assert "20 consecutive steps were skipped" in proc.stderr and "gradient norm is rising" in proc.stderr
    recs = read_metrics(run)
    assert max(r["train/guard_rebaselines"] for r in recs) == 0 and recs[-1]["step"] < 60


def test_trainer_accepts_a_level_shift_of_the_grad_norm(cache, tmp_path):
    run = tmp_path / "run"
    proc = run_train(BASE, cache, run, "checkpoint.every_steps=100", DFLASH_TEST_FAULTS=JUMP)
    recs = {r["step"]: r for r in read_metrics(run)}
    skipped = [s for s, r in recs.items() if r["train/skipped"]]
    assert 1 <= len(skipped) <= GuardsConfig().rebaseline_after and min(skipped) == 14, skipped
    assert max(recs) == 30 and recs[30]["train/guard_rebaselines"] == 1
    assert "accepted as a level shift" in proc.stderr and "not a level shift yet" in proc.stderr
    assert recs[30]["train/grad_norm_limit"] > 40 * recs[10]["train/grad_norm_limit"] / GuardsConfig().min_ratio


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_stop_message_names_the_optimizers_lr_and_no_resume_without_a_checkpoint(cache, tmp_path, optimizer):
    run = tmp_path / "run"
    proc = run_train(BASE, cache, run, "train.max_steps=40", f"train.optimizer={optimizer}", "checkpoint.every_steps=100",
                     "guards.rebaseline_after=0", expect=3, DFLASH_TEST_FAULTS=JUMP)
    err = proc.stderr
    assert "20 consecutive steps were skipped" in err and "no checkpoint was written yet" in err
    assert "resume" not in err.split("consecutive steps were skipped")[1]
    assert ("train.muon_lr" in err) == (optimizer == "muon") and "train.lr" in err


def test_resume_in_the_middle_of_a_level_shift_is_bitwise(cache, tmp_path):
    # the checkpoint at step 16 holds two skipped spikes of the shift that starts at step 14: a resume from it
    # must re-baseline at the same step and train on with the same losses as the uninterrupted run
    import shutil

    straight = tmp_path / "straight"
    sets = ("checkpoint.every_steps=4", "checkpoint.keep_last=20")
    run_train(BASE, cache, straight, *sets, DFLASH_TEST_FAULTS=JUMP)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for ckpt in (resumed / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > 16:
            shutil.rmtree(ckpt)
    proc = run_train(BASE, cache, resumed, *sets, DFLASH_TEST_FAULTS=JUMP)
    assert "resumed from" in proc.stderr and "step-00000016" in proc.stderr
    want = {r["step"]: (r["train/loss"], r["train/skipped"], r["train/guard_rebaselines"]) for r in read_metrics(straight)}
    got = {r["step"]: (r["train/loss"], r["train/skipped"], r["train/guard_rebaselines"]) for r in read_metrics(resumed)}
    assert got == want and want[30][2] == 1 and want[16][1] == 1


def test_a_resume_inside_the_window_after_a_level_shift_refuses_a_second_shift_up_as_the_straight_run(cache, tmp_path):
    """The norm x40 from step 14 (accepted as a level shift), then x40 again from step 30, well inside
    guards.window: the uninterrupted run refuses the second shift and stops with exit 3. A run resumed from the
    checkpoint at step 24 (after the accepted shift, before the second) remembers the first shift (the guard's
    since_shift is part of its checkpointed state) and does the same, step for step; without that memory it
    would re-baseline the second shift and train on."""
    import shutil

    faults = json.dumps({"grad_shifts": [[14, 40.0], [30, 40.0]]})
    sets = ("train.max_steps=60", "checkpoint.every_steps=4", "checkpoint.keep_last=20")
    straight = tmp_path / "straight"
    proc = run_train(BASE, cache, straight, *sets, expect=3, DFLASH_TEST_FAULTS=faults)
    assert "a second level shift up" in proc.stderr, proc.stderr[-2000:]
    want = {r["step"]: (r["train/loss"], r["train/skipped"], r["train/guard_rebaselines"]) for r in read_metrics(straight)}
    first_skips = [s for s, (_, skipped, _) in want.items() if skipped and s < 30]
    assert first_skips and min(first_skips) == 14 and max(first_skips) < 24 and want[24][2] == 1
    assert all(want[s][1] for s in range(30, max(want) + 1)) and want[max(want)][2] == 1
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for ckpt in (resumed / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > 24:
            shutil.rmtree(ckpt)
    proc = run_train(BASE, cache, resumed, *sets, expect=3, DFLASH_TEST_FAULTS=faults)
    assert "step-00000024" in proc.stderr and "a second level shift up" in proc.stderr, proc.stderr[-2000:]
    got = {r["step"]: (r["train/loss"], r["train/skipped"], r["train/guard_rebaselines"]) for r in read_metrics(resumed)}
    assert got == want

"""``dflash-train report``: spikes, skips, gaps, saves and coincidences, from a real run and by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from train.report import analyze, cli_main

ROOT = Path(__file__).resolve().parents[1]


def _records(n: int = 40) -> list[dict]:
    recs = []
    for s in range(1, n + 1):
        r = {"step": s, "loss": 3.0 - 0.01 * s + (0.02 if s % 2 else -0.02), "grad_norm": 1.0,
             "bucket": s % 3, "epoch": 0 if s <= 20 else 1, "acceptance_length": 1.5, "skipped": 0,
             "perf/data_wait_ms": 1.0, "perf/queue_depth": 4}
        recs.append(r)
    recs[29]["loss"] = 50.0  # step 30: spike next to the save at step 30, bucket 0
    recs[29]["ckpt_blocking_ms"] = 3.5
    recs[20]["loss"] = 40.0  # step 21: spike at the epoch boundary
    return recs


def test_analyze_by_hand():
    recs = _records()
    del recs[10]  # step 11 missing
    recs.append(dict(recs[-1]))  # step 40 duplicated
    rep = analyze(recs, window=16, z_threshold=6.0)
    assert rep.missing_steps == [11] and rep.duplicate_steps == [40]
    assert [s.step for s in rep.spikes] == [21, 30]
    s21, s30 = rep.spikes
    assert s21.epoch_boundary and not s21.near_checkpoint
    assert s30.near_checkpoint and s30.bucket == 0 and s30.grad_norm == 1.0
    assert rep.saves == [(30, 3.5)] and rep.epoch_boundaries == [21]


def test_report_on_a_run_with_injected_spike_and_nan(tmp_path, capsys):
    from dflash_cache.synthetic import make_synthetic_cache

    cache = str(tmp_path / "cache")
    make_synthetic_cache(cache, n_samples=48, hidden_size=64, num_layers=8, target_layer_ids=(1, 3, 5),
                         vocab_size=512, max_length=256, median_length=64, seed=1)
    run = tmp_path / "run"
    sets = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.tokens_per_batch=512",
            "train.num_anchors=16", "train.max_steps=14", "checkpoint.every_steps=5", "guards.min_history=4"]
    cmd = [sys.executable, "-m", "train.cli", str(ROOT / "configs" / "tiny.toml"), "--cache", cache,
           "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]]
    env = dict(os.environ, DFLASH_TEST_FAULTS='{"nan_steps": [7], "spike_steps": [12]}')
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]

    png = tmp_path / "report.png"
    assert cli_main([str(run), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "no gaps, no duplicates" in out
    assert "skipped steps: 2" in out
    assert "step 7: nonfinite_loss" in out and "step 12: grad_norm_spike" in out
    spike_lines = [line for line in out.splitlines() if line.startswith("  step 12: loss")]
    assert spike_lines and "skipped by guards" in spike_lines[0] and "bucket" in spike_lines[0]
    assert "checkpoint saves: 3" in out  # steps 5, 10, 14
    assert png.stat().st_size > 10_000

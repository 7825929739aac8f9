"""``dflash-train report``: spikes, skips, gaps, saves and coincidences, from a real run and by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from train.components.metrics import read_metrics
from train.tools.report import analyze, cli_main, format_report, loss_ticks, report_figure

ROOT = Path(__file__).resolve().parents[1]


def _records(n: int = 40) -> list[dict]:
    recs = []
    for s in range(1, n + 1):
        r = {"step": s, "kind": "train", "train/loss": 3.0 - 0.01 * s + (0.02 if s % 2 else -0.02),
             "train/grad_norm": 1.0, "train/bucket": s % 3, "train/epoch": 0 if s <= 20 else 1,
             "train/acceptance_length": 1.5, "train/skipped": 0, "train/step_time_s": 0.5,
             "perf/data_wait_ms": 1.0, "perf/queue_depth": 4}
        recs.append(r)
    recs[29]["train/loss"] = 50.0  # step 30: spike next to the save at step 30, bucket 0
    recs.insert(30, {"step": 30, "kind": "save", "ckpt/blocking_ms": 3.5})
    recs.insert(32, {"step": 31, "kind": "commit", "ckpt/write_s": 0.25, "ckpt/committed_step": 30})
    recs.insert(20, {"step": 20, "kind": "eval", "eval/acceptance_length": 1.75, "eval/seconds": 4.0})
    recs[21]["train/loss"] = 40.0  # step 21: spike at the epoch boundary
    return recs


def test_analyze_by_hand():
    recs = _records()
    del recs[10]  # step 11 missing
    recs.append(dict(recs[-1]))  # step 40 duplicated
    rep = analyze(recs, window=16, z_threshold=6.0)
    assert rep.n_records == 40 and rep.missing_steps == [11] and rep.duplicate_steps == [40]
    assert [s.step for s in rep.spikes] == [21, 30]
    s21, s30 = rep.spikes
    assert s21.epoch_boundary and not s21.near_checkpoint
    assert s30.near_checkpoint and s30.bucket == 0 and s30.grad_norm == 1.0
    assert rep.saves == [(30, 3.5)] and rep.commits == [(30, 0.25)] and rep.epoch_boundaries == [21]
    assert rep.evals == [(20, 1.75)]
    # eval and checkpoint time are reported beside the training steps' time, not inside it
    assert rep.seconds == {"training steps": 20.0, "held-out eval": 4.0, "checkpoint blocking": 0.0035}
    text = format_report(rep, "RUN")
    assert "step 30: blocked 3.5 ms, written in 0.25 s" in text
    assert "held-out eval: 1 at steps 20; acceptance length 1.750 -> 1.750" in text


def test_loss_ticks_are_round_numbers_in_range():
    assert loss_ticks(2.0, 6.5) == [2, 3, 4, 5, 6]  # a typical loss range: five labels, not just "2" and "5"
    assert [f"{v:g}" for v in loss_ticks(0.05, 12)] == ["0.05", "0.1", "0.2", "0.5", "1", "2", "5", "10"]
    assert loss_ticks(3, 1.2e7) == [10.0**k for k in range(1, 8)]  # an exploded loss: one label per decade
    assert [f"{v:g}" for v in loss_ticks(6.23, 6.28)] == ["6.23", "6.24", "6.25", "6.26", "6.27", "6.28"]


def test_report_on_a_run_with_injected_spike_and_nan(tmp_path, capsys):
    from dflash_cache.synthetic import make_synthetic_cache

    cache = str(tmp_path / "cache")
    make_synthetic_cache(cache, n_samples=48, hidden_size=64, num_layers=8, target_layer_ids=(1, 3, 5),
                         vocab_size=512, max_length=256, median_length=64, seed=1)
    run = tmp_path / "run"
    sets = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.tokens_per_batch=512",
            "train.num_anchors=16", "train.max_steps=14", "checkpoint.every_steps=5", "guards.min_history=4",
            "loader.holdout_fraction=0.2", "eval.every_steps=5"]
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
    # a clean run logs every commit, the last one included
    assert "commit not logged" not in out and out.count("written in") == 3, out
    assert "held-out eval: 2 at steps 5, 10" in out
    assert png.stat().st_size > 10_000

    fig = report_figure(read_metrics(run, kind=None), analyze(read_metrics(run, kind=None)), title="my-run")
    ax1, ax2, ax3 = fig.axes
    # the grad norm with the guard's limit: the cause of a skip or a stop is visible
    assert [t.get_text() for t in ax3.get_legend().get_texts()] == [
        "pre-clip grad norm", "guard limit (above: spike)", "skipped step", "checkpoint save"]
    train = read_metrics(run)
    norm, limit = ax3.get_lines()[:2]
    logged = [float(r["train/grad_norm"]) for r in train]  # step 7's NaN is logged as "nan"
    assert np.array_equal(norm.get_ydata(), logged, equal_nan=True)
    limits = [(r["step"], r["train/grad_norm_limit"]) for r in train if "train/grad_norm_limit" in r]
    assert list(limit.get_xdata()) == [s for s, _ in limits] and list(limit.get_ydata()) == [v for _, v in limits]
    assert limits and limits[0][0] == 5  # armed once guards.min_history (4) steps were accepted
    spike = next(r for r in train if r["step"] == 12)
    assert spike["train/grad_norm"] > spike["train/grad_norm_limit"]
    assert fig._suptitle.get_text() == "my-run"
    legend1 = [t.get_text() for t in ax1.get_legend().get_texts()]
    legend2 = [t.get_text() for t in ax2.get_legend().get_texts()]
    assert legend1 == ["loss", "loss (smoothed)", "loss spike", "skipped step", "checkpoint save"]
    assert legend2 == ["acceptance length (training batches)", "acceptance length (held-out eval)",
                       "skipped step", "checkpoint save"]
    held_out = ax2.get_lines()[1]
    assert list(held_out.get_xdata()) == [5, 10]
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax1.get_yticklabels() if t.get_text()]
    assert len(ticks) >= 3 and all(re.fullmatch(r"[0-9.]+(e\+[0-9]+)?", t) for t in ticks), ticks  # no mathtext
    # a clean run without spikes or skips shows no legend entries for them
    clean = [r for r in read_metrics(run, kind=None) if r["step"] <= 6]
    fig = report_figure(clean, analyze(clean, min_history=100))
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["loss", "loss (smoothed)",
                                                                            "checkpoint save"]

"""MetricLogger: one record per step in JSONL and TensorBoard, honest smoothing, resume without gaps."""

from __future__ import annotations

import math

import pytest

from train.components.metrics import METRICS_FILE, MetricLogger, read_metrics
from train.config import MetricsConfig


def _tb_steps(run_dir, tag="train/loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_every_step_logged_and_smoothing_divides_by_covered_steps(tmp_path):
    m = MetricLogger(tmp_path, MetricsConfig(smoothing_window=4))
    for step in range(1, 4):
        rec = m.log(step, {"train/loss": float(step), "train/lr": 0.1, "train/skipped": 0, "train/bucket": 1})
    assert rec["train/loss_smooth"] == pytest.approx(2.0)  # (1+2+3)/3, not /4
    m.log(4, {"train/loss": math.nan, "train/skipped": 1, "train/skip_reason": "nonfinite_loss",
              "train/skipped_sample_ids": [3, 4]})
    rec = m.log(5, {"train/loss": 5.0, "train/skipped": 0})
    assert rec["train/loss_smooth"] == pytest.approx((1 + 2 + 3 + 5) / 4)  # skipped step excluded
    m.close()
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[3]["train/loss"] == "nan" and recs[3]["train/skipped_sample_ids"] == [3, 4]
    assert [s for s, _ in _tb_steps(tmp_path)] == [1, 2, 3, 4, 5]


def test_steps_must_increase(tmp_path):
    m = MetricLogger(tmp_path, MetricsConfig(tensorboard=False))
    m.log(1, {"train/loss": 1.0})
    with pytest.raises(ValueError, match="steps must increase"):
        m.log(1, {"train/loss": 1.0})
    m.close()


def test_resume_drops_steps_past_checkpoint(tmp_path):
    m = MetricLogger(tmp_path, MetricsConfig())
    for step in range(1, 9):
        m.log(step, {"train/loss": float(step)})
    m.close()
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 9, "lo')  # torn last line from a crash
    # the checkpoint was at step 5: steps 6..8 will be recomputed
    m = MetricLogger(tmp_path, MetricsConfig(smoothing_window=2), resume_step=5)
    rec = m.log(6, {"train/loss": 60.0})
    assert rec["train/loss_smooth"] == pytest.approx((5 + 60) / 2)
    for step in range(7, 11):
        m.log(step, {"train/loss": float(step) * 10})
    m.close()
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 11))
    tb = dict(_tb_steps(tmp_path))
    assert sorted(tb) == list(range(1, 11))
    assert tb[6] == 60.0 and tb[5] == 5.0


def test_disabled_logger_writes_nothing(tmp_path):
    m = MetricLogger(tmp_path / "run", MetricsConfig(), enabled=False)
    m.log(1, {"train/loss": 1.0})
    m.close()
    assert not (tmp_path / "run").exists()

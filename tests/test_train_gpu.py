"""On a CUDA device: bf16 autocast training, pinned-memory checkpoint snapshots, resume continues."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from train.components.checkpoint import find_latest, read_checkpoint
from train.components.metrics import read_metrics


@pytest.mark.gpu
def test_train_on_gpu_with_bf16_autocast_and_resume(tmp_path):
    from dflash_cache.runtime.config import load_config
    from dflash_cache.synthetic import make_synthetic_cache
    from train.loop.loop import train

    cache = str(tmp_path / "cache")
    make_synthetic_cache(cache, n_samples=48, hidden_size=64, num_layers=8, target_layer_ids=(1, 3, 5),
                         vocab_size=512, max_length=256, median_length=64)

    def cfg(steps: int):
        return load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml", ["model.mask_token_id=511", "metrics.progress_bar=false",
                                                 f"train.max_steps={steps}", "checkpoint.every_steps=3",
                                                 "checkpoint.allow_config_change=true"])

    result = train(cfg(6), cache, tmp_path / "run")
    assert result.step == 6 and result.skipped == 0
    ckpt = read_checkpoint(find_latest(tmp_path / "run"))
    assert all(t.device.type == "cpu" for t in ckpt.model.values())
    train(cfg(9), cache, tmp_path / "run")
    recs = read_metrics(tmp_path / "run")
    assert [r["step"] for r in recs] == list(range(1, 10))
    assert all(math.isfinite(r["train/loss"]) for r in recs)

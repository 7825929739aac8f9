"""The shipped loader, drafters and loss module fit the Protocols the loop, objective and export are typed
against (``train.protocols``), and something that lacks a member does not."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from fixtures.drafters import tiny_drafter
from fixtures.trainer import small_cache

from dflash_cache.store import open_cache
from train.config import LoaderConfig
from train.data.loader import StreamingLoader
from train.loop.build import LossModule
from train.protocols import Drafter, Objective, TrainingLoader


def test_the_streaming_loader_is_a_training_loader(tmp_path):
    cache = open_cache(small_cache(str(tmp_path / "cache"), n_samples=8))
    with StreamingLoader(cache, LoaderConfig(tokens_per_batch=512, holdout_fraction=0.0), seed=0, num_anchors=16,
                         block_size=4, max_epochs=1) as loader:
        assert isinstance(loader, TrainingLoader)
        assert loader.epoch_lengths(1)[0] > 0 and loader.status == "idle"


def test_the_drafters_and_the_loss_module_fit_their_protocols():
    drafter = tiny_drafter()
    assert isinstance(drafter, Drafter)
    cfg = drafter.config
    for field in ("block_size", "mask_token_id", "hidden_size", "target_layer_ids"):  # DrafterShape
        assert hasattr(cfg, field), field
    assert isinstance(LossModule(drafter, num_anchors=8), Objective)
    headless = SimpleNamespace(config=cfg, parameters=drafter.parameters)  # no lm_head, not callable
    assert not isinstance(headless, Drafter)
    assert not isinstance(SimpleNamespace(counters=None, last_stats=None), TrainingLoader)
    assert isinstance(drafter.lm_head, torch.Tensor)

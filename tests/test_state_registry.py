"""The checkpoint's state registered by name: saved and restored per name, and a checkpoint whose names differ
from the registered ones (one missing, one unknown) refused with the name, through ``resume`` too."""

from __future__ import annotations

import pytest
import torch
from fixtures.trainer import CONFIG, small_cache

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.dist import Distributed
from train.components.checkpoint import Checkpointer, CheckpointError
from train.components.guards import SpikeGuard
from train.components.state import resume, training_components, training_state
from train.components.stateful import StateMismatchError, StateRegistry
from train.loop.build import build_loader, build_model, build_optimizer, build_scheduler, open_training_cache

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16"]


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_registry_saves_and_restores_each_name():
    a, b = Counter(3), Counter(5)
    saved = StateRegistry(reserved=("step",)).register("a", a).register("b", b).state_dict()
    assert saved == {"a": {"n": 3}, "b": {"n": 5}}
    a2, b2 = Counter(), Counter()
    StateRegistry(reserved=("step",)).register("a", a2).register("b", b2).load_state_dict({**saved, "step": 9})
    assert (a2.n, b2.n) == (3, 5)


def test_registry_refuses_a_missing_and_an_unknown_name_before_loading_anything():
    a = Counter()
    reg = StateRegistry(reserved=("step",)).register("a", a).register("b", Counter())
    with pytest.raises(StateMismatchError, match=r"missing 'b'") as err:
        reg.load_state_dict({"a": {"n": 1}, "step": 1}, "ckpt/step-1")
    assert "ckpt/step-1" in str(err.value) and a.n == 0  # nothing loaded
    with pytest.raises(StateMismatchError, match=r"unexpected 'rng'"):
        reg.load_state_dict({"a": {"n": 1}, "b": {"n": 2}, "rng": [1, 2]})
    assert a.n == 0
    assert issubclass(StateMismatchError, CheckpointError)  # a DFlashError: exit 2 with the message


def test_registry_refuses_a_taken_name_and_a_component_without_state():
    reg = StateRegistry(reserved=("step",)).register("a", Counter())
    with pytest.raises(ValueError, match="'a' is already taken"):
        reg.register("a", Counter())
    with pytest.raises(ValueError, match="'step' is already taken"):
        reg.register("step", Counter())
    with pytest.raises(TypeError, match="state 'x': a int has no state_dict"):
        reg.register("x", 3)


def test_resume_refuses_a_checkpoint_with_an_unregistered_or_missing_name(tmp_path):
    cache_url = small_cache(str(tmp_path / "cache"))
    cfg = load_config(CONFIG, BASE)
    cache = open_training_cache(cache_url, cfg.loader)
    d = Distributed.start(use_cuda=False)
    loaders = []

    def components():
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, cache, d.device)
        optimizer = build_optimizer(cfg.train, model)
        loader = build_loader(cfg.loader, cache, d, seed=cfg.train.seed, epochs=cfg.train.epochs,
                              num_anchors=cfg.train.num_anchors, block_size=cfg.model.block_size)
        loaders.append(loader)
        scheduler = build_scheduler(cfg.train, optimizer, total_steps=50)
        return model, training_components(optimizer, scheduler, loader, SpikeGuard(cfg.guards), d)

    try:
        for run, edit, named in (("extra", lambda s: {**s, "rng": [0]}, "unexpected 'rng'"),
                                 ("missing", lambda s: {k: v for k, v in s.items() if k != "guard"}, "missing 'guard'")):
            model, comps = components()
            ckpt = Checkpointer(tmp_path / run, cfg.checkpoint, cache_fingerprint=cache.spec.fingerprint)
            ckpt.save(1, model.state_dict(), edit(training_state(1, comps, cache, d)))
            ckpt.close()
            model2, comps2 = components()
            ckpt2 = Checkpointer(tmp_path / run, cfg.checkpoint, cache_fingerprint=cache.spec.fingerprint)
            with pytest.raises(StateMismatchError, match=named) as err:
                resume(cfg.checkpoint, ckpt2, cache, model2, comps2, d)
            assert "step-00000001" in str(err.value)
            ckpt2.close()
    finally:
        for ld in loaders:
            ld.close()
        d.close()

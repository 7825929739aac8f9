"""Assembly of a training run: each ``build_*`` takes its own config section and returns one component.

``train.loop.loop.train`` calls these once at start-up; tests and benchmarks call them directly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from dflash_cache.errors import DFlashError
from dflash_cache.protocols import ReadableCache
from dflash_cache.runtime.dist import Distributed
from train.config import LoaderConfig, ModelConfig, TrainConfig

from ..components.optim import CombinedOptimizer, is_muon_matrix
from ..data.batch import Batch
from ..models.distill import DistributionLoss, distill_loss
from ..models.objective import (
    DEFAULT_CHUNK_ROWS,
    DPaceWeighting,
    ExpDecayWeighting,
    PositionWeighting,
    default_gamma,
    dflash_loss,
)
from ..protocols import Objective, TrainingLoader

log = logging.getLogger(__name__)


def build_model(model_cfg: ModelConfig, cache: ReadableCache, device: torch.device) -> nn.Module:
    """The drafter on ``device`` in fp32 (master weights); only its own layers are trainable."""
    from ..models.factory import build_drafter

    model = build_drafter(model_cfg, cache.spec, cache.load_head()).to(device)
    for p in model.parameters():  # fp32 master weights; the frozen head buffers keep their dtype (memory)
        p.data = p.data.float()
    # the frozen embedding / lm_head are buffers; make sure nothing else sneaks in as trainable
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    return model


def drafter_metadata(model: nn.Module) -> dict[str, str]:
    """Stored in every checkpoint's model.safetensors: export needs no cache to rebuild the drafter."""
    from ..models.model import METADATA_KEY

    return {METADATA_KEY: model.config.to_json()}


def build_optimizer(train_cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW over every trainable parameter, or Muon for the 2-D weight matrices and
    AdamW for the rest, as one :class:`~train.components.optim.CombinedOptimizer` (Muon's group first)."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw_kw = dict(lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay)
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **adamw_kw)
    matrices = [p for p in params if is_muon_matrix(p)]
    others = [p for p in params if not is_muon_matrix(p)]
    parts: dict[str, torch.optim.Optimizer] = {
        "muon": torch.optim.Muon(matrices, lr=train_cfg.muon_lr, weight_decay=train_cfg.muon_weight_decay,
                                 momentum=train_cfg.muon_momentum, ns_steps=train_cfg.muon_ns_steps,
                                 adjust_lr_fn=train_cfg.muon_adjust_lr),
    }
    if others:
        parts["adamw"] = torch.optim.AdamW(others, **adamw_kw)
    return CombinedOptimizer(parts)


def lr_lambda(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the ``step``-th applied update (0-based): linear warmup, cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(train_cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    warmup = math.ceil(train_cfg.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, total_steps, warmup, train_cfg.min_lr_ratio)
    )


def build_loader(loader_cfg: LoaderConfig, cache: ReadableCache, d: Distributed, *, seed: int, epochs: int,
                 num_anchors: int, block_size: int) -> TrainingLoader:
    """The streaming loader over this rank's slice of the plan (batches land on the training device).
    ``num_anchors`` (train.num_anchors) and ``block_size`` (model.block_size) size the plan's block budget."""
    from ..data.loader import StreamingLoader

    return StreamingLoader(cache, loader_cfg, seed=seed, num_anchors=num_anchors, block_size=block_size,
                           rank=d.rank, world_size=d.world_size, device=d.device, max_epochs=epochs,
                           agree_parts=d.decided_by_main if d.world_size > 1 else None)


def batch_stream(loader: TrainingLoader, epochs: int) -> Iterator[Batch]:
    """Every remaining batch of this rank, epoch after epoch (the loader yields one epoch per pass)."""
    while loader.epoch < epochs:
        yield from loader


def total_steps_for(train_cfg: TrainConfig, epoch_lengths: Sequence[int]) -> int:
    """Optimizer steps of the run: all batches of all epochs over grad_accum, capped by max_steps."""
    total = sum(epoch_lengths) // train_cfg.grad_accum
    if total < 1:
        raise DFlashError(
            f"the run has {sum(epoch_lengths)} batches per rank, fewer than train.grad_accum="
            f"{train_cfg.grad_accum}; lower train.grad_accum or loader.tokens_per_batch, or add data"
        )
    return min(total, train_cfg.max_steps) if train_cfg.max_steps else total


def autocast_context(train_cfg: TrainConfig, device: torch.device):
    """bf16 autocast on GPU (auto/bf16); fp32 on CPU unless bf16 is asked for explicitly."""
    use_bf16 = train_cfg.precision == "bf16" or (train_cfg.precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def build_position_weighting(train_cfg: TrainConfig, block_size: int) -> PositionWeighting:
    """``train.loss_weighting``: the reference exp-decay (``loss_gamma``, default by block size) or D-PACE."""
    if train_cfg.loss_weighting == "dpace":
        return DPaceWeighting(train_cfg.dpace_alpha)
    return ExpDecayWeighting(train_cfg.loss_gamma or default_gamma(block_size))


class LossModule(nn.Module):
    """Wraps the drafter so DDP sees the whole loss computation as its forward."""

    def __init__(self, drafter: nn.Module, num_anchors: int, weighting: PositionWeighting | None = None,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS):
        super().__init__()
        self.drafter = drafter
        self.num_anchors = num_anchors
        self.weighting = weighting
        self.chunk_rows = chunk_rows
        self.selector: Any = None  # train.models.dflash2.SelectorLoss when the drafter trains through dflash2_loss

        self.distribution: DistributionLoss | None = None  # train.loss other than ce (train/models/distill.py)

    def forward(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        if self.selector is not None:  # DFlash2, or a drafter with a unary logit transform (train.models.dflash2)
            from ..models.dflash2 import dflash2_loss

            out = dflash2_loss(self.drafter, batch, num_anchors=self.num_anchors, weighting=self.weighting,
                               chunk_rows=self.chunk_rows, selector=self.selector)
        elif self.distribution is not None:
            out = distill_loss(self.drafter, batch, self.distribution, num_anchors=self.num_anchors,
                               weighting=self.weighting, chunk_rows=self.chunk_rows)
        else:
            out = dflash_loss(self.drafter, batch, num_anchors=self.num_anchors, weighting=self.weighting,
                              chunk_rows=self.chunk_rows)
        return out.loss, out.metrics


def build_loss_module(train_cfg: TrainConfig, model: nn.Module, d: Distributed) -> Objective:
    weighting = build_position_weighting(train_cfg, model.config.block_size)
    loss_module = LossModule(model, train_cfg.num_anchors, weighting, train_cfg.logits_chunk_rows)
    loss_module.selector = build_selector_loss(train_cfg, model)
    if train_cfg.loss != "ce":  # (the config refuses it together with a selector loss)
        loss_module.distribution = DistributionLoss(train_cfg.loss, train_cfg.loss_ce_weight, train_cfg.lk_eta)
    module: nn.Module = loss_module
    if d.enabled:
        ids = [d.device.index] if d.device.type == "cuda" else None
        module = nn.parallel.DistributedDataParallel(module, device_ids=ids)
    return module


def build_selector_loss(train_cfg: TrainConfig, model: nn.Module) -> Any:
    """``train.selector_*`` for a drafter that trains through ``dflash2_loss`` (DFlash2, or a logit transform)."""
    from ..models.dflash2 import SelectorLoss, uses_dflash2_loss

    if not uses_dflash2_loss(model.config):
        return None
    return SelectorLoss(train_cfg.selector_alpha, train_cfg.selector_gold_outside, train_cfg.selector_detach_backbone)


def refuse_unfinished(cache: Any, allow: bool) -> Any:
    """``cache``, unless its extraction has not finished (``dflash_cache.extraction``): then an error naming
    how far it got and the command that finishes it, or with ``allow`` (``loader.allow_unfinished``) a
    warning."""
    from dflash_cache.errors import CacheError
    from dflash_cache.extraction import FINISH, extraction_state

    # (parts scanned only when unfinished; unreadable records are for loader.on_corrupt to judge)
    state = extraction_state(cache.storage, lambda: cache.scan_parts()[0])
    if not state.unfinished:
        return cache
    finish = FINISH.replace("CACHE", cache.url)
    if allow:
        log.warning("%s: %s; training on the committed units only (loader.allow_unfinished); %s", cache.url,
                    state.describe(), finish)
        return cache
    raise CacheError(f"{cache.url}: {state.describe()}; {finish}, or train on the committed units with --set "
                     "loader.allow_unfinished=true (or follow the extraction with --set loader.live=true)")


def open_training_cache(url: str, loader_cfg: LoaderConfig) -> Any:
    """The cache to train on. Live mode (``loader.live``) may start before extraction: it waits, saying what
    for, until the cache exists and holds the teacher's frozen head (``loader.live_timeout_s`` bounds the wait)."""
    from dflash_cache import open_cache
    from dflash_cache.errors import CacheNotFoundError, NotACacheError

    if not loader_cfg.live:
        return refuse_unfinished(open_cache(url), loader_cfg.allow_unfinished)
    t0, last_log = time.monotonic(), -math.inf
    while True:
        try:
            cache = open_cache(url)
            if cache.has_head():
                return cache
            waiting = "extraction to store the teacher's embedding and lm_head"
        except (CacheNotFoundError, NotACacheError):  # not yet created, or being created (root written last)
            waiting = "extraction to create the cache"
        waited = time.monotonic() - t0
        if loader_cfg.live_timeout_s is not None and waited >= loader_cfg.live_timeout_s:
            raise CacheNotFoundError(
                f"live: waited {waited:.0f} s (loader.live_timeout_s) for {waiting} at {url}; start "
                f"`dflash-extract CONFIG --out {url}`, check the --cache path, or raise loader.live_timeout_s")
        if time.monotonic() - last_log >= 30.0:
            log.info("live: waiting for %s at %s (waited %.0f s; loader.live_timeout_s = %s)", waiting, url, waited,
                     loader_cfg.live_timeout_s)
            last_log = time.monotonic()
        time.sleep(loader_cfg.live_poll_s)

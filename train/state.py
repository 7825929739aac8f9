"""What a resume needs beyond the weights: RNG states, the training state dict, and the checks that the
checkpoint belongs to this cache and this job shape before anything is loaded."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from dflash_cache.errors import DFlashError, SpecMismatchError
from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.schema import CheckpointConfig

from .checkpoint import Checkpointer, LoadedCheckpoint
from .guards import SpikeGuard
from .optim import check_resumable

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(step: int, optimizer, scheduler, loader, guard: SpikeGuard, cache: Any,
                   d: Distributed) -> dict[str, Any]:
    """Everything a resume needs; loader position and RNG are per rank (each rank reads its own slice)."""
    return {
        "step": step,
        "world_size": d.world_size,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loader": d.gather_objects(loader.state_dict()),
        "guard": guard.state_dict(),
        "rng": d.gather_objects(rng_state()),
        "cache_spec": cache.spec.to_dict(),
    }


def check_cache_compatible(ckpt: LoadedCheckpoint, cache: Any, ignore: bool) -> None:
    """Refuse to resume on a cache other than the one the checkpoint was trained on."""
    saved_fp = ckpt.manifest.get("cache_fingerprint")
    if saved_fp == cache.spec.fingerprint:
        return
    from dflash_cache.spec import CacheSpec

    saved = CacheSpec.from_dict(ckpt.state["cache_spec"])
    fields = saved.diff(cache.spec) or ["fingerprint"]
    detail = ", ".join(fields)
    if ignore:
        log.warning("resuming %s on a cache that differs in %s (checkpoint.ignore_fingerprint_mismatch)",
                    ckpt.path, detail)
        return
    raise SpecMismatchError(
        f"checkpoint {ckpt.path} was trained on cache fingerprint {saved_fp}, but {cache.url} has "
        f"{cache.spec.fingerprint} (differs in: {detail}); use the original cache, a new --run-dir, or "
        "--set checkpoint.ignore_fingerprint_mismatch=true to resume anyway",
        fields=fields,
    )


def resume(ckpt_cfg: CheckpointConfig, ckpt: Checkpointer, cache: Any, model, optimizer, scheduler, loader,
           guard: SpikeGuard, d: Distributed) -> int:
    """Load the latest valid checkpoint of the run into every component; returns its step (0: none)."""
    latest = ckpt.load_latest()
    if latest is None:
        return 0
    if not ckpt_cfg.resume:
        raise DFlashError(
            f"checkpoint.resume is false but {latest.path.parent} already holds checkpoints (latest: step "
            f"{latest.step}); starting over there would mix two runs. Use a new --run-dir, or delete "
            f"{latest.path.parent} to start this one from scratch"
        )
    check_cache_compatible(latest, cache, ckpt_cfg.ignore_fingerprint_mismatch)
    saved_world = int(latest.state["world_size"])
    if saved_world != d.world_size:
        raise DFlashError(
            f"checkpoint {latest.path} was written by a run with {saved_world} process(es), this run has "
            f"{d.world_size}; each rank resumes its own slice of the plan, so resume with "
            f"--nproc-per-node {saved_world} (or start a new --run-dir)"
        )
    check_resumable(optimizer, latest.state["optimizer"], str(latest.path))
    model.load_state_dict(latest.model)
    optimizer.load_state_dict(latest.state["optimizer"])
    scheduler.load_state_dict(latest.state["scheduler"])
    loader.load_state_dict(latest.state["loader"][d.rank])
    guard.load_state_dict(latest.state["guard"])
    set_rng_state(latest.state["rng"][d.rank])
    log.info("resumed from %s (step %d)", latest.path, latest.step)
    return latest.step

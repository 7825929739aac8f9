"""Process-group plumbing for ``torchrun`` / ``accelerate launch`` (gloo on CPU, NCCL + gloo on GPU)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Ranks finish their units at different times; the final reduction must not time out on the slowest.
_TIMEOUT = timedelta(hours=24)


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @classmethod
    def from_env(cls) -> DistContext:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        ctx = cls(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
        if world > 1 and not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(ctx.local_rank % torch.cuda.device_count())
            dist.init_process_group(backend=backend, timeout=_TIMEOUT)
            ctx.initialized_here = True
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if not torch.cuda.is_available():
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        return ctx

    @property
    def active(self) -> bool:
        return self.world > 1 and dist.is_initialized()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def sum_counts(self, counts: dict[str, float]) -> dict[str, float]:
        """Element-wise sum of ``counts`` over ranks (same keys on every rank)."""
        if not self.active:
            return dict(counts)
        keys = sorted(counts)
        t = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def store(self) -> Any:
        """The launcher's key-value store (for the aggregated progress view), or None."""
        if not self.active:
            return None
        try:
            return dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError):
            return None

    def close(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


class SharedCounters:
    """Each rank publishes its counters to the store; rank 0 reads everyone's (no collectives)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self._store = ctx.store()

    def publish(self, counts: dict[str, float]) -> None:
        if self._store is not None:
            self._store.set(f"dflash-progress/{self.ctx.rank}", json.dumps(counts))

    def totals(self, own: dict[str, float]) -> dict[str, float]:
        out = dict(own)
        if self._store is None:
            return out
        for r in range(self.ctx.world):
            key = f"dflash-progress/{r}"
            if r == self.ctx.rank or not self._store.check([key]):
                continue
            for k, v in json.loads(self._store.get(key)).items():
                out[k] = out.get(k, 0) + v
        return out

"""One optimizer step: forward/backward over the micro-batches, the guards, then the update.

A skipped step (non-finite or spiking loss / gradient norm) leaves parameters, optimizer moments and
the learning-rate schedule bitwise unchanged. Metrics are exact sums over micro-batches and ranks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dflash_cache.errors import ConfigError
from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.switches import env_switch
from train.config import TrainConfig

from ..components.guards import SpikeGuard, Verdict
from ..data.batch import Batch
from ..protocols import Objective
from .build import autocast_context

FAULTS_ENV = "DFLASH_TEST_FAULTS"


@dataclass(frozen=True)
class FaultPlan:
    """Test and drill hook (never set in production): the loss of each step in ``nan_steps`` becomes NaN,
    of each step in ``spike_steps`` is multiplied by ``spike_scale``, before backward, on the real code path.

    From step ``grad_scale_from`` on, the gradient (not the logged loss) is multiplied by ``grad_scale``: a
    lasting level shift of the gradient norm that a scale-invariant optimizer (AdamW, Muon) trains through;
    with ``grad_growth`` also by ``grad_growth ** (step - grad_scale_from)``: a norm growing geometrically
    under an unchanged loss. Each ``[step, factor]`` of ``grad_shifts`` multiplies the gradient by ``factor``
    from ``step`` on, on top of the above: several level shifts, one after another.

    Set through ``DFLASH_TEST_FAULTS='{"nan_steps": [5], "spike_steps": [9], "spike_scale": 1e6}'``."""

    nan_steps: frozenset[int] = field(default_factory=frozenset)
    spike_steps: frozenset[int] = field(default_factory=frozenset)
    spike_scale: float = 1e6
    grad_scale_from: int | None = None
    grad_scale: float = 1.0
    grad_growth: float = 1.0
    grad_shifts: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_env(cls) -> FaultPlan:
        raw = env_switch(FAULTS_ENV)
        if not raw:
            return cls()
        try:
            spec = json.loads(raw)
            plan = cls(frozenset(int(s) for s in spec.get("nan_steps", [])),
                       frozenset(int(s) for s in spec.get("spike_steps", [])),
                       float(spec.get("spike_scale", 1e6)),
                       None if spec.get("grad_scale_from") is None else int(spec["grad_scale_from"]),
                       float(spec.get("grad_scale", 1.0)), float(spec.get("grad_growth", 1.0)),
                       tuple((int(s), float(f)) for s, f in spec.get("grad_shifts", [])))
        except (ValueError, TypeError, AttributeError) as err:
            raise ConfigError(f"{FAULTS_ENV}={raw!r}: expected a JSON object with nan_steps / spike_steps lists "
                              f"and an optional spike_scale, grad_scale_from / grad_scale / grad_growth, grad_shifts "
                              f"[[step, factor], ...] ({err})") from None
        return plan

    def backward_scale(self, step: int) -> float:
        """The gradient multiplier of ``step`` (1.0 unless a level shift is injected)."""
        shifts = math.prod(f for s, f in self.grad_shifts if step >= s)
        if self.grad_scale_from is None or step < self.grad_scale_from:
            return shifts
        return shifts * self.grad_scale * self.grad_growth ** (step - self.grad_scale_from)

    def scale(self, step: int) -> float:
        """The loss multiplier of ``step``: NaN, ``spike_scale`` or 1.0."""
        if step in self.nan_steps:
            return math.nan
        if step in self.spike_steps:
            return self.spike_scale
        return 1.0


NO_FAULTS = FaultPlan()


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    verdict: Verdict
    lr: float
    metrics: dict[str, Any]  # acceptance_length, accuracy_per_position, loss per bucket ...


def train_step(
    step: int,
    micro_batches: Sequence[Batch],
    loss_module: Objective,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    guard: SpikeGuard,
    train_cfg: TrainConfig,
    d: Distributed,
    faults: FaultPlan = NO_FAULTS,
) -> StepResult:
    """Forward/backward over the micro-batches, guard, then (unless skipped) clip + optimizer step + schedule.

    The logged lr is the first parameter group's: AdamW's, or Muon's with ``train.optimizer = "muon"``."""
    device = d.device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lr = optimizer.param_groups[0]["lr"]
    scale = faults.scale(step)
    n_micro = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    acc = MetricSums()
    for i, batch in enumerate(micro_batches):
        batch = batch.to(device)
        sync = i == n_micro - 1 or not d.enabled  # DDP all-reduces gradients on the last micro-batch
        with nullcontext() if sync else loss_module.no_sync():
            with autocast_context(train_cfg, device):
                loss, metrics = loss_module(batch)
            loss = loss.float() * scale  # []; scale is 1.0 unless a fault is injected on this step
            (loss * faults.backward_scale(step) / n_micro).backward()
        loss_sum += loss.detach().float()
        acc.add(batch.bucket, loss.detach().float(), metrics)
    # pre-clip total norm; identical on every rank since DDP has averaged the gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip).float()
    loss_mean = d.all_reduce_(loss_sum.reshape(1)).item() / (n_micro * d.world_size)
    gn = grad_norm.item()
    verdict = guard.check(loss_mean, gn)
    if not verdict.skip:
        optimizer.step()
        scheduler.step()
    guard.update(verdict, loss_mean, gn)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_mean, gn, verdict, lr, acc.finish(d))


class MetricSums:
    """Exact aggregation of the objective's sums over micro-batches (and ranks)."""

    def __init__(self) -> None:
        self.n_blocks: Tensor | None = None
        self.accepted: Tensor | None = None
        self.pos_correct: Tensor | None = None
        self.pos_count: Tensor | None = None
        self.bucket_loss: dict[int, list[Tensor]] = {}
        self.extra: dict[str, Tensor] = {}  # "sums/..." metrics of the objective (DFlash2's selector), summed

    def add(self, bucket: int, loss: Tensor, m: dict[str, Tensor]) -> None:
        def plus(a: Tensor | None, b: Tensor) -> Tensor:
            b = b.detach().double()
            return b if a is None else a + b

        self.n_blocks = plus(self.n_blocks, m["n_blocks"])
        self.accepted = plus(self.accepted, m["accepted_sum"])
        self.pos_correct = plus(self.pos_correct, m["position_correct"])
        self.pos_count = plus(self.pos_count, m["position_count"])
        self.bucket_loss.setdefault(int(bucket), []).append(loss)
        for k, v in m.items():
            if k.startswith("sums/"):
                self.extra[k] = plus(self.extra.get(k), v)

    def finish(self, d: Distributed) -> dict[str, Any]:
        assert self.n_blocks is not None and self.accepted is not None
        assert self.pos_correct is not None and self.pos_count is not None
        # [2 + 2*(B-1)]: one all-reduce for every block metric
        packed = torch.cat([self.n_blocks.reshape(1), self.accepted.reshape(1), self.pos_correct, self.pos_count])
        packed = d.all_reduce_(packed).cpu()
        nb = int(packed[0].item())
        k = (packed.numel() - 2) // 2
        correct, count = packed[2 : 2 + k], packed[2 + k :]
        out: dict[str, Any] = {
            "n_blocks": nb,
            "acceptance_length": 1.0 + float(packed[1]) / max(nb, 1),
            "accuracy_per_position": (correct / count.clamp(min=1)).tolist(),
        }
        # per-bucket loss of this rank's micro-batches (buckets differ between ranks)
        out["bucket_loss"] = {b: float(torch.stack(v).mean()) for b, v in self.bucket_loss.items()}
        if self.extra:
            from ..models.dflash2 import selector_summary

            names = sorted(self.extra)
            packed = d.all_reduce_(torch.cat([self.extra[k].reshape(-1) for k in names])).cpu()
            sums, i = {}, 0
            for k in names:
                n = self.extra[k].numel()
                sums[k], i = packed[i:i + n], i + n
            out["tags"] = selector_summary(sums, unary_tau=out["acceptance_length"])
        return out

"""Step guards: skip a step whose loss or gradient is non-finite or far outside recent history.

Gradient clipping bounds the size of an update but not its direction: a batch whose pre-clip
gradient norm is 1000x the usual still moves the weights by a full clipped step in a direction
dominated by that batch. :class:`SpikeGuard` compares the pre-clip grad norm and the loss with
robust statistics (median and MAD) of a trailing window of *accepted* steps and rejects outliers
(more than ``z_threshold`` robust sigmas and ``min_ratio`` times the median above it).
Rejected values never enter the window, so one explosion cannot widen the bounds for the next.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from dflash_cache.errors import DFlashError
from dflash_cache.runtime.schema import GuardsConfig

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution * 1.4826 = its standard deviation


class TooManySkipsError(DFlashError):
    """The guards rejected too many consecutive steps: the run cannot make progress."""

    exit_code = 3


@dataclass(frozen=True)
class Verdict:
    skip: bool
    reason: str | None = None  # "nonfinite_loss" | "nonfinite_grad" | "grad_norm_spike" | "loss_spike"
    loss_z: float = 0.0
    grad_z: float = 0.0


def robust_z(value: float, history: list[float] | deque[float]) -> tuple[float, float]:
    """``(z, median)``: z = (value - median) / (1.4826 * MAD) over ``history`` (MAD floored at 1e-12)."""
    xs = sorted(history)
    med = _median(xs)
    mad = _median(sorted(abs(x - med) for x in xs))
    return (value - med) / max(MAD_TO_SIGMA * mad, 1e-12), med


def _median(sorted_xs: list[float]) -> float:
    n = len(sorted_xs)
    mid = n // 2
    return sorted_xs[mid] if n % 2 else 0.5 * (sorted_xs[mid - 1] + sorted_xs[mid])


class SpikeGuard:
    """Decides per step whether to apply the update; owns the trailing window (checkpointed)."""

    def __init__(self, cfg: GuardsConfig) -> None:
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=cfg.window)
        self.consecutive_skips = 0
        self.total_skips = 0

    def check(self, loss: float, grad_norm: float) -> Verdict:
        """Judge one step from its loss and pre-clip gradient norm. Does not change the window."""
        if not math.isfinite(loss):
            return Verdict(True, "nonfinite_loss")
        if not math.isfinite(grad_norm):
            return Verdict(True, "nonfinite_grad")
        if len(self.grad_norms) < self.cfg.min_history:
            return Verdict(False)
        grad_z, grad_med = robust_z(grad_norm, self.grad_norms)
        loss_z, loss_med = robust_z(loss, self.losses)
        # only upward excursions are harmful; a sudden drop in loss is not a reason to skip
        if self._is_spike(grad_norm, grad_z, grad_med):
            return Verdict(True, "grad_norm_spike", loss_z, grad_z)
        if self._is_spike(loss, loss_z, loss_med):
            return Verdict(True, "loss_spike", loss_z, grad_z)
        return Verdict(False, None, loss_z, grad_z)

    def _is_spike(self, value: float, z: float, median: float) -> bool:
        return z > self.cfg.z_threshold and value > self.cfg.min_ratio * median

    def update(self, verdict: Verdict, loss: float, grad_norm: float) -> None:
        """Record the outcome of a step: accepted values enter the window, skips are counted."""
        if verdict.skip:
            self.consecutive_skips += 1
            self.total_skips += 1
            return
        self.consecutive_skips = 0
        self.losses.append(float(loss))
        self.grad_norms.append(float(grad_norm))

    @property
    def should_stop(self) -> bool:
        return self.consecutive_skips >= self.cfg.max_consecutive_skips

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "consecutive_skips": self.consecutive_skips,
            "total_skips": self.total_skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque((float(x) for x in state["losses"]), maxlen=self.cfg.window)
        self.grad_norms = deque((float(x) for x in state["grad_norms"]), maxlen=self.cfg.window)
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])

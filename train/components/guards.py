"""Step guards: skip a step whose loss or gradient is non-finite or far outside recent history.

Gradient clipping bounds the size of an update but not its direction: a batch whose pre-clip
gradient norm is 1000x the usual still moves the weights by a full clipped step in a direction
dominated by that batch. :class:`SpikeGuard` compares the pre-clip grad norm and the loss with
robust statistics (median and MAD) of a trailing window of *accepted* steps and rejects outliers
(more than ``z_threshold`` robust sigmas and ``min_ratio`` times the median above it).
Rejected values never enter the window, so one explosion cannot widen the bounds for the next.

A window of accepted steps alone cannot follow a healthy run whose gradient norm settles at a new
level (early training often moves it 10-20x within a few steps): every later step would look like a
spike, and the run would be stopped although the loss keeps falling. So the guard also remembers the
last ``4 * rebaseline_after`` finite steps, skipped ones included. A grad-norm spike that finds
``rebaseline_after`` spikes among them is judged as a level shift:

- accepted (**re-baseline**) when the norm is not rising across those spikes (the median of their
  later half is at most ``rebaseline_max_rise`` x that of their earlier half) and the loss is not
  rising (the median loss of their later half is at most ``rebaseline_max_loss_z`` robust sigmas
  above the median of the ``rebaseline_after`` accepted steps before the first spike; sigma: the
  window's batch-to-batch noise, from successive differences, so a falling loss's trend does not widen it): the grad-norm window is replaced by the spikes' norms and the step is applied;
- refused otherwise (norm or loss rising: a divergence): the step is skipped, and
  ``max_consecutive_skips`` skips in a row stop the run (exit code 3). A second level shift up within
  ``window`` steps of an accepted one is refused too: a norm that grows geometrically (a few percent a step,
  under a flat loss) rises too slowly across one set of spikes for the test above, but would otherwise be
  re-baselined again and again while it climbs by orders of magnitude.

So a level shift costs at most ``rebaseline_after`` skipped steps; an isolated spike (a few adversarial
batches) never reaches that count and is skipped with the optimizer untouched; non-finite values and
loss spikes are never re-baselined.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from dflash_cache.errors import DFlashError
from train.config import GuardsConfig

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
    grad_limit: float = math.inf  # pre-clip grad norms above this are spikes (inf: not armed yet)
    rebaseline: bool = False  # a sustained level shift of the grad norm: the window is replaced, the step applied


def robust_z(value: float, history: list[float] | deque[float]) -> tuple[float, float]:
    """``(z, median)``: z = (value - median) / (1.4826 * MAD) over ``history`` (MAD floored at 1e-12)."""
    med, sigma = robust_stats(history)
    return (value - med) / sigma, med


def robust_stats(history: list[float] | deque[float]) -> tuple[float, float]:
    """``(median, sigma)`` with sigma = 1.4826 * MAD, floored at 1e-12."""
    xs = sorted(history)
    med = _median(xs)
    mad = _median(sorted(abs(x - med) for x in xs))
    return med, max(MAD_TO_SIGMA * mad, 1e-12)


def _step_noise(xs: list[float]) -> float:
    """Robust sigma of a series' batch-to-batch noise, from successive differences (blind to a steady trend)."""
    diffs = [b - a for a, b in zip(xs[:-1], xs[1:], strict=True)]
    return robust_stats(diffs)[1] / math.sqrt(2) if diffs else 1e-12


def _median(sorted_xs: list[float]) -> float:
    n = len(sorted_xs)
    mid = n // 2
    return sorted_xs[mid] if n % 2 else 0.5 * (sorted_xs[mid - 1] + sorted_xs[mid])


class SpikeGuard:
    """Decides per step whether to apply the update; owns the trailing windows (checkpointed)."""

    def __init__(self, cfg: GuardsConfig) -> None:
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=cfg.window)
        self.consecutive_skips = 0
        self.total_skips = 0
        self.rebaselines = 0
        # (loss, grad norm, was a grad-norm spike) of the last finite steps, skipped ones included
        self.recent: deque[tuple[float, float, bool]] = deque(maxlen=self._recent_len)
        self.last_refusal: str | None = None  # why the last level-shift test refused (for the stop message)
        # (median, batch-to-batch noise) of the accepted losses just before the first spike still in `recent`
        self.loss_before: tuple[float, float] | None = None
        self.since_shift: int | None = None  # steps since the last accepted level shift (None: none yet)

    @property
    def _recent_len(self) -> int:
        return max(1, 4 * self.cfg.rebaseline_after)

    def check(self, loss: float, grad_norm: float) -> Verdict:
        """Judge one step from its loss and pre-clip gradient norm. Does not change the windows."""
        if not math.isfinite(loss):
            return Verdict(True, "nonfinite_loss")
        if not math.isfinite(grad_norm):
            return Verdict(True, "nonfinite_grad")
        if len(self.grad_norms) < self.cfg.min_history and not self.rebaselines:
            return Verdict(False)
        grad_z, grad_med = robust_z(grad_norm, self.grad_norms)
        loss_z, loss_med = robust_z(loss, self.losses)
        limit = self._limit(self.grad_norms)
        # only upward excursions are harmful; a sudden drop in loss is not a reason to skip
        if grad_norm > limit:
            if self.level_shift_refusal(loss, grad_norm) is None:
                return Verdict(False, None, loss_z, grad_z, limit, rebaseline=True)
            return Verdict(True, "grad_norm_spike", loss_z, grad_z, limit)
        if loss > self._limit(self.losses):
            return Verdict(True, "loss_spike", loss_z, grad_z, limit)
        return Verdict(False, None, loss_z, grad_z, limit)

    def _limit(self, history: deque[float]) -> float:
        """The value above which a step is a spike: ``z_threshold`` sigmas *and* ``min_ratio`` x the median."""
        med, sigma = robust_stats(history)
        return max(med + self.cfg.z_threshold * sigma, self.cfg.min_ratio * med)

    def level_shift_refusal(self, loss: float, grad_norm: float) -> str | None:
        """None if a grad-norm spike with these values completes a sustained level shift (accept it and
        re-baseline), else why not, as a sentence."""
        spikes = [(x, g) for x, g, spike in self.recent if spike]
        if self.cfg.rebaseline_after == 0:
            return "level shifts are never accepted (guards.rebaseline_after = 0)"
        if len(spikes) < self.cfg.rebaseline_after:
            return (f"{len(spikes)} grad-norm spikes in the last {len(self.recent)} steps "
                    f"(a level shift needs {self.cfg.rebaseline_after})")
        norms = [g for _, g in spikes] + [grad_norm]
        half = len(norms) // 2
        early, late = _median(sorted(norms[:half])), _median(sorted(norms[half:]))
        if late > self.cfg.rebaseline_max_rise * early:
            return f"the gradient norm is rising (median {early:.4g} -> {late:.4g} across the spikes)"
        # the loss at the end of the spikes against the loss just before the first of them: a model that
        # diverged ends higher; the whole window's median would lag a loss that has been falling
        loss_before, loss_noise = self.loss_before if self.loss_before is not None else robust_stats(self.losses)
        spike_losses = [x for x, _ in spikes] + [loss]
        loss_late = _median(sorted(spike_losses[len(spike_losses) // 2:]))
        if loss_late > loss_before + self.cfg.rebaseline_max_loss_z * loss_noise:
            return f"the loss is rising ({loss_before:.4g} before the spikes, {loss_late:.4g} at their end)"
        if self.since_shift is not None and self.since_shift < self.cfg.window:
            return (f"the gradient norm is rising: a second level shift up {self.since_shift} steps after the "
                    f"last accepted one (median {early:.4g} -> {late:.4g} across these spikes; guards.window = "
                    f"{self.cfg.window})")
        return None

    def update(self, verdict: Verdict, loss: float, grad_norm: float) -> None:
        """Record the outcome of a step: accepted values enter the window, skips are counted."""
        if self.since_shift is not None:
            self.since_shift += 1
        if verdict.rebaseline:
            self.since_shift = 0
            spike_norms = [g for _, g, spike in self.recent if spike]
            self.grad_norms = deque(spike_norms + [float(grad_norm)], maxlen=self.cfg.window)
            self.losses.append(float(loss))
            self.rebaselines += 1
            self.consecutive_skips = 0
            self.recent.clear()
            self.last_refusal = self.loss_before = None
            return
        if math.isfinite(loss) and math.isfinite(grad_norm):
            spike = verdict.reason == "grad_norm_spike"
            if spike and self.cfg.rebaseline_after:
                if not any(s for _, _, s in self.recent):  # the first spike: remember the loss before it
                    before = list(self.losses)[-self.cfg.rebaseline_after:] or [float(loss)]
                    self.loss_before = (_median(sorted(before)), _step_noise(list(self.losses)))
                self.last_refusal = self.level_shift_refusal(loss, grad_norm)
            self.recent.append((float(loss), float(grad_norm), spike))
            if not any(s for _, _, s in self.recent):
                self.loss_before = None
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
            "rebaselines": self.rebaselines,
            "recent": [list(r) for r in self.recent],
            "loss_before": None if self.loss_before is None else list(self.loss_before),
            "since_shift": self.since_shift,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque((float(x) for x in state["losses"]), maxlen=self.cfg.window)
        self.grad_norms = deque((float(x) for x in state["grad_norms"]), maxlen=self.cfg.window)
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])
        # checkpoints written before the level-shift rule carry no history of skipped steps
        self.rebaselines = int(state.get("rebaselines", 0))
        self.recent = deque(((float(x), float(g), bool(s)) for x, g, s in state.get("recent", [])),
                            maxlen=self._recent_len)
        self.last_refusal = None
        before = state.get("loss_before")
        self.loss_before = None if before is None else (float(before[0]), float(before[1]))
        since = state.get("since_shift")  # (checkpoints written before this rule: no shift remembered)
        self.since_shift = None if since is None else int(since)

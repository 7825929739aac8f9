"""Measured peak memory of a piece of work, on the device it runs on.

CUDA: the caching allocator's peak (``max_memory_allocated``) above what was allocated before. CPU: torch's
memory profiler, which records every tensor allocation and free; the peak of the resulting timeline above
its start. Both count tensor memory only (not the allocator's cache or the Python heap), which is what
``dflash-train estimate`` predicts.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[int, Any]:
    """``(peak bytes of tensors allocated while fn() ran, above the level at its start; fn's result)``."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, result
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        # deprecated for CUDA in favour of memory snapshots, which do not exist for the CPU allocator
        warnings.simplefilter("ignore", FutureWarning)
        path = os.path.join(d, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    totals = [sum(s) for s in sizes]
    return (max(totals) - totals[0] if totals else 0), result


PHASES = ("forward", "loss_head", "backward", "optimizer")
_MARK_BYTES = 999_983  # an odd size no tensor of a step has: the phase marks found again in the CPU timeline


class PhaseMeter:
    """Peak tensor memory per phase of a piece of work, each above the level at the work's start (so a
    phase's peak includes what earlier phases left alive, e.g. the activations during the loss head).

    ``mark(name)`` ends the current phase and starts ``name`` (a name met again takes the larger peak); hooks
    inside the work call it (:func:`measure_train_step`). CUDA: the allocator's peak, reset at every mark.
    CPU: one profile of the whole work; every mark allocates a tensor of a size no real tensor has, which
    finds the mark again in the memory timeline."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.order: list[str] = []
        self.peaks: dict[str, int] = {}
        self._base = 0

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            self._close_cuda()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            torch.empty(_MARK_BYTES + 2 * len(self.order), dtype=torch.uint8)  # freed at once: only a mark
        self.order.append(name)

    def _close_cuda(self) -> None:
        if self.order:
            name = self.order[-1]
            peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def run(self, fn: Callable[[], Any], first: str) -> Any:
        """Runs ``fn`` as phase ``first`` (and whatever ``mark`` starts inside it); fills ``peaks``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.mark(first)
            result = fn()
            torch.cuda.synchronize(self.device)
            self._close_cuda()
            return result
        acts = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
            self.mark(first)
            result = fn()
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            path = os.path.join(d, "timeline.raw.json.gz")
            prof.export_memory_timeline(path, device="cpu")
            with gzip.open(path, "rt") as f:
                events = json.load(f)
        self._read_timeline(events)
        return result

    def _read_timeline(self, events: list[list[int]]) -> None:
        """events: (time, action, bytes, category) in time order; action 1 pre-existing, 2 create, 3 in-place
        (a -bytes, +bytes pair), 4 destroy (bytes negative)."""
        marks = {_MARK_BYTES + 2 * i: name for i, name in enumerate(self.order)}
        level, start, phase = 0, None, None
        for _t, action, nbytes, _cat in events:
            if abs(nbytes) in marks and action in (2, 4):
                if action == 2:
                    phase = marks[abs(nbytes)]
                    start = level if start is None else start
                continue
            level += nbytes if action != 4 else -abs(nbytes)
            if phase is not None:
                self.peaks[phase] = max(self.peaks.get(phase, 0), level - start)


def measure_train_step(step_fn: Callable[[], Any], loss_module: nn.Module, drafter: nn.Module,
                       optimizer: torch.optim.Optimizer, device: torch.device | str = "cpu"
                       ) -> tuple[dict[str, int], Any]:
    """``(peak bytes per phase above the step's start, step_fn's result)`` of one training step, phases marked
    where the real step crosses them: the drafter's forward, then the loss head (the drafter returned), the
    backward (the loss's first gradient node runs), the optimizer (its step begins; clipping counts as
    backward). Keys: :data:`PHASES`."""
    meter = PhaseMeter(device)

    def loss_done(_m: Any, _args: Any, out: Any) -> None:
        loss = out[0] if isinstance(out, tuple) else out.loss
        if loss.grad_fn is not None:
            loss.grad_fn.register_prehook(lambda _grads: meter.mark("backward"))

    handles = [drafter.register_forward_hook(lambda *_: meter.mark("loss_head")),
               loss_module.register_forward_hook(loss_done),
               optimizer.register_step_pre_hook(lambda *_: meter.mark("optimizer"))]
    try:
        result = meter.run(step_fn, "forward")
    finally:
        for h in handles:
            h.remove()
    return {p: meter.peaks.get(p, 0) for p in PHASES}, result

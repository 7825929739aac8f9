"""Measured peak memory of a piece of work, on the device it runs on.

CUDA: the caching allocator's peak (``max_memory_allocated``) above what was allocated before. CPU: torch's
memory profiler, which records every tensor allocation and free; the peak of the resulting timeline above
its start. Both count tensor memory only (not the allocator's cache or the Python heap), which is what
``dflash-train estimate`` predicts.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch


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

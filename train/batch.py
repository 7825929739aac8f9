"""The unit the loader hands the trainer: one token-budget batch from one bucket.

Rows are either one sample each, padded to the longest sample in the batch, or (with
``loader.packing``) several samples packed back to back. ``doc_ids`` tells the model where
each document starts and ends in its row, so a mask built from it never lets one document
see another; ``position_ids`` restart at 0 for each document.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

_TENSOR_FIELDS = ("features", "input_ids", "loss_mask", "doc_ids", "position_ids", "sample_ids")


@dataclass
class Batch:
    features: Tensor  # [R, T, n*H] bf16
    input_ids: Tensor  # [R, T] int64 (pad 0)
    loss_mask: Tensor  # [R, T] bool (False on padding)
    doc_ids: Tensor  # [R, T] int32: document index within its row, -1 on padding
    position_ids: Tensor  # [R, T] int64, restarting at 0 for each document (0 on padding)
    sample_ids: Tensor  # [S] int64, in row-major order (row 0's documents first)
    bucket: int
    epoch: int
    index: int  # batch index within the epoch on this rank
    n_tokens: int  # real (non-padding) tokens
    n_padded: int  # padding slots: R * T - n_tokens
    seed: int  # deterministic from (seed, epoch, index, rank): anchor sampling uses it

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def padding_fraction(self) -> float:
        total = self.n_tokens + self.n_padded
        return self.n_padded / total if total else 0.0

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        """Copy every tensor to ``device``. With pinned host tensors and ``non_blocking`` the
        copy is asynchronous with respect to the host (issue it on a side stream to keep it
        off the compute stream)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TENSOR_FIELDS}
        return replace(self, **moved)

    def pin_memory(self) -> Batch:
        """Page-locked copies of the tensors (only meaningful when a CUDA device exists)."""
        if not torch.cuda.is_available():
            return self
        pinned = {name: getattr(self, name).pin_memory() for name in _TENSOR_FIELDS}
        return replace(self, **pinned)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in _TENSOR_FIELDS))

    def equal(self, other: Batch) -> bool:
        """Bitwise equality of every tensor and every scalar field."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, Tensor):
                if a.dtype != b.dtype or a.shape != b.shape:
                    return False
                if not torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.int16) if b.dtype == torch.bfloat16 else b):
                    return False
            elif a != b:
                return False
        return True

"""Token-budget batches of similar length, deterministic for a given list of samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .template import TokenizedSample


@dataclass
class Batch:
    samples: list[TokenizedSample]
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    attention_mask: torch.Tensor  # [B, T] int64

    @property
    def n_real(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def n_computed(self) -> int:
        return self.input_ids.numel()


def plan_batches(samples: Sequence[TokenizedSample], tokens_per_batch: int, max_batch_size: int,
                 batch_overhead: float = 0.02) -> list[list[TokenizedSample]]:
    """Split samples (longest first, ties by id) into batches with ``rows * longest <= tokens_per_batch``.

    Contiguous runs of the sorted order are chosen by dynamic programming to minimise the computed
    tokens (rows x longest) plus ``batch_overhead * tokens_per_batch`` per batch, so batches stay
    large but never mix very different lengths. A sample longer than the budget is a batch of its
    own. The result depends only on the samples.
    """
    order = sorted(samples, key=lambda s: (-s.length, s.sample_id))
    n = len(order)
    penalty = batch_overhead * tokens_per_batch
    best = [0.0] + [float("inf")] * n  # best[j]: cost of batching order[:j]
    cut = [0] * (n + 1)
    for i in range(n):  # a batch starts at i; order[i] is its longest sample
        longest = order[i].length
        rows_cap = max(1, min(max_batch_size, tokens_per_batch // longest))
        for j in range(i + 1, min(n, i + rows_cap) + 1):
            cost = best[i] + (j - i) * longest + penalty
            if cost < best[j]:
                best[j], cut[j] = cost, i
    batches = []
    j = n
    while j > 0:
        batches.append(order[cut[j]:j])
        j = cut[j]
    return batches[::-1]


def collate(samples: list[TokenizedSample], pad_id: int) -> Batch:
    """Right-pad to the longest sample of the batch."""
    t = max(s.length for s in samples)
    ids = torch.full((len(samples), t), pad_id, dtype=torch.int64)  # [B, T]
    mask = torch.zeros((len(samples), t), dtype=torch.int64)  # [B, T]
    for i, s in enumerate(samples):
        ids[i, : s.length] = torch.from_numpy(s.input_ids)
        mask[i, : s.length] = 1
    return Batch(samples, ids, mask)

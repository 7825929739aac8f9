"""The DFlash training objective: anchors, blocks, weighted CE, and exact acceptance metrics.

For a batch (rows of one or more packed documents):

1. **Anchors**: per row, up to ``num_anchors`` positions drawn without replacement from the
   eligible ones (loss mask on at ``a`` and ``a+1``, both in the same document), using a
   ``torch.Generator`` seeded from ``batch.seed`` (reproducible; the loader's seed changes with the
   epoch, so anchors are re-drawn every epoch). Sorted. Rows with fewer eligible positions get
   padding blocks (``valid = False``).
2. **Blocks**: block ``n`` is ``[x_a, MASK x (B-1)]`` at positions ``p_a .. p_a + B-1``.
3. **Loss**: CE of block row ``k`` (1..B-1) against token ``a+k`` (same position, no shift),
   weighted ``exp(-(k-1)/gamma)``; a row counts only if ``a+k`` is inside the row, in the anchor's
   document and on the loss mask. Weighted mean over all counted rows.
4. **Metrics**: accuracy per block position, and the exact acceptance length per valid block
   ``1 + (number of leading correct rows)`` (an invalid row ends the run), averaged over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import BlockLayout

# gamma of the loss weights exp(-(k-1)/gamma), as published for these block sizes.
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """7 for B=16, 5 for B=10, 4 for B=8 (the published values); piecewise-linear in between, and
    extended with the slope of the nearest segment outside [8, 16] (B=4 -> 2, B=32 -> 12.33),
    never below 1."""
    pts = _GAMMA_POINTS
    if block_size <= pts[0][0]:
        (b0, g0), (b1, g1) = pts[0], pts[1]
    elif block_size >= pts[-1][0]:
        (b0, g0), (b1, g1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(1, len(pts)) if block_size <= pts[i][0])
        (b0, g0), (b1, g1) = pts[i - 1], pts[i]
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


class BatchLike(Protocol):
    features: Tensor  # [R, T, n*H]
    input_ids: Tensor  # [R, T]
    loss_mask: Tensor  # [R, T]
    doc_ids: Tensor  # [R, T]
    position_ids: Tensor  # [R, T]
    seed: int


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable
    metrics: dict[str, Tensor]  # detached: see block_metrics()


def eligible_anchors(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """[R, T] bool: positions that may anchor a block (a and a+1 on the loss mask, same document)."""
    lm = loss_mask.bool()
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return ok


def sample_anchors(eligible: Tensor, num_anchors: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Up to ``num_anchors`` eligible positions per row, without replacement, sorted.

    eligible [R, T] bool -> anchors [R, N] int64, valid [R, N] bool, N = min(num_anchors, max count) >= 1.
    The random keys are drawn on the CPU from ``generator`` so the draw is identical on any device."""
    R, T = eligible.shape
    counts = eligible.sum(1)  # [R]
    n = max(1, min(num_anchors, int(counts.max().item()) if R else 0))
    keys = torch.rand(R, T, generator=generator).to(eligible.device)  # [R, T] in [0, 1)
    keys = torch.where(eligible, keys, torch.full_like(keys, 2.0))  # ineligible last
    picked = keys.topk(n, dim=1, largest=False).indices  # [R, n]
    valid = torch.arange(n, device=eligible.device).unsqueeze(0) < counts.unsqueeze(1)  # [R, n]
    anchors = torch.where(valid, picked, torch.zeros_like(picked))
    # sort the valid anchors ascending, padding blocks (key T) after them
    order = torch.where(valid, anchors, torch.full_like(anchors, T)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def all_anchors(eligible: Tensor) -> tuple[Tensor, Tensor]:
    """Every eligible position (evaluation): anchors [R, N], valid [R, N], N = max count per row."""
    R, T = eligible.shape
    counts = eligible.sum(1)
    n = max(1, int(counts.max().item()) if R else 1)
    pos = torch.arange(T, device=eligible.device).expand(R, T)
    keyed = torch.where(eligible, pos, torch.full_like(pos, T))
    anchors = keyed.sort(dim=1).values[:, :n]
    valid = anchors < T
    return torch.where(valid, anchors, torch.zeros_like(anchors)), valid


@dataclass
class Blocks:
    """The block inputs and targets for a set of anchors."""

    layout: BlockLayout
    block_ids: Tensor  # [R, N*B] block input tokens: x_a then MASK
    block_positions: Tensor  # [R, N*B] absolute positions p_a + k
    targets: Tensor  # [R, N, B] token at a+k (row 0 unused)
    row_valid: Tensor  # [R, N, B] bool: row k counts (k >= 1, in row, same doc, on the loss mask)


def build_blocks(batch: BatchLike, anchors: Tensor, valid: Tensor, block_size: int, mask_token_id: int) -> Blocks:
    R, T = batch.input_ids.shape
    N, B = anchors.shape[1], block_size
    device = batch.input_ids.device
    k = torch.arange(B, device=device)  # [B]
    idx = anchors.unsqueeze(-1) + k  # [R, N, B]
    in_row = idx < T
    idx_c = idx.clamp(max=T - 1).view(R, N * B)
    targets = batch.input_ids.gather(1, idx_c).view(R, N, B)
    same_doc = batch.doc_ids.gather(1, idx_c).view(R, N, B) == batch.doc_ids.gather(1, anchors).unsqueeze(-1)
    on_mask = batch.loss_mask.bool().gather(1, idx_c).view(R, N, B)
    row_valid = valid.unsqueeze(-1) & in_row & same_doc & on_mask & (k > 0)
    anchor_tok = batch.input_ids.gather(1, anchors)  # [R, N]
    block_ids = torch.full((R, N, B), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = torch.where(valid, anchor_tok, torch.full_like(anchor_tok, mask_token_id))
    block_positions = batch.position_ids.gather(1, anchors).unsqueeze(-1) + k  # [R, N, B]
    layout = BlockLayout(anchors=anchors, valid=valid, doc_ids=batch.doc_ids, block_size=B)
    return Blocks(layout, block_ids.view(R, N * B), block_positions.view(R, N * B), targets, row_valid)


def loss_weights(block_size: int, gamma: float, device: torch.device) -> Tensor:
    """[B] weights: 0 for the anchor row, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0
    return w


def block_metrics(pred: Tensor, blocks: Blocks) -> dict[str, Tensor]:
    """Exact per-batch metrics from greedy predictions pred [R, N, B] (row k predicts token a+k).

    Returns detached tensors; the sums make aggregation across batches exact:
      n_blocks (valid blocks), accepted_sum (sum over blocks of leading correct rows),
      position_correct [B-1], position_count [B-1], acceptance_length (1 + accepted_sum / n_blocks),
      accuracy_per_position [B-1]."""
    correct = (pred == blocks.targets) & blocks.row_valid  # [R, N, B]
    valid = blocks.layout.valid
    run = correct[..., 1:].long().cumprod(dim=-1)  # [R, N, B-1]: 1 while every row so far was right
    accepted = run.sum(-1)[valid]  # [n_valid]
    n_blocks = valid.sum()
    pos_correct = correct[..., 1:][valid].sum(0)  # [B-1]
    pos_count = blocks.row_valid[..., 1:][valid].sum(0)  # [B-1]
    return finalize_metrics({
        "n_blocks": n_blocks.detach(),
        "accepted_sum": accepted.sum().detach(),
        "position_correct": pos_correct.detach(),
        "position_count": pos_count.detach(),
    })


def finalize_metrics(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """Add the means (acceptance_length, accuracy_per_position) to a dict of sums."""
    n = sums["n_blocks"].clamp(min=1).float()
    out = dict(sums)
    out["acceptance_length"] = 1.0 + sums["accepted_sum"].float() / n
    out["accuracy_per_position"] = sums["position_correct"].float() / sums["position_count"].clamp(min=1).float()
    return out


def merge_metrics(a: dict[str, Tensor] | None, b: dict[str, Tensor]) -> dict[str, Tensor]:
    """Exact aggregate of two metric dicts (sums add; means recomputed)."""
    keys = ("n_blocks", "accepted_sum", "position_correct", "position_count")
    if a is None:
        return finalize_metrics({k: b[k] for k in keys})
    return finalize_metrics({k: a[k] + b[k] for k in keys})


def forward_blocks(model: Any, batch: BatchLike, anchors: Tensor, valid: Tensor) -> tuple[Tensor, Blocks]:
    """Run the drafter on the blocks at ``anchors``: logits [R, N, B, V] and the blocks."""
    cfg = model.config
    blocks = build_blocks(batch, anchors, valid, cfg.block_size, cfg.mask_token_id)
    hidden = model(batch.features, blocks.block_ids, batch.position_ids, blocks.block_positions, blocks.layout)
    R, N = anchors.shape
    logits = model.logits(hidden).view(R, N, cfg.block_size, -1)
    return logits, blocks


def dflash_loss(model: Any, batch: BatchLike, *, num_anchors: int = 512, gamma: float | None = None,
                generator: torch.Generator | None = None) -> LossOutput:
    """The training loss and metrics of one batch. ``generator`` defaults to one seeded with ``batch.seed``."""
    B = model.config.block_size
    gamma = default_gamma(B) if gamma is None else gamma
    if generator is None:
        generator = torch.Generator().manual_seed(int(batch.seed))
    anchors, valid = sample_anchors(eligible_anchors(batch.loss_mask, batch.doc_ids), num_anchors, generator)
    logits, blocks = forward_blocks(model, batch, anchors, valid)  # [R, N, B, V]
    ce = F.cross_entropy(logits.flatten(0, 2).float(), blocks.targets.flatten(), reduction="none")
    w = loss_weights(B, gamma, logits.device) * blocks.row_valid.float()  # [R, N, B]
    total_w = w.sum()
    loss = (ce * w.flatten()).sum() / total_w.clamp(min=1e-6)
    metrics = block_metrics(logits.detach().argmax(-1), blocks)
    metrics["loss"] = loss.detach()
    metrics["weight_sum"] = total_w.detach()
    return LossOutput(loss=loss, metrics=metrics)


def metrics_to_floats(metrics: dict[str, Tensor]) -> dict[str, Any]:
    """Host-side values for logging (one sync): scalars -> float, vectors -> list[float]."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        v = v.detach().cpu()
        out[k] = v.item() if v.ndim == 0 else [float(x) for x in v.tolist()]
    return out

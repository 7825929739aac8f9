"""The DFlash training objective: anchors, blocks, weighted CE (chunked), and exact acceptance metrics.

For a batch (rows of one or more packed documents, flattened into one context; see ``train.models.attention``):

1. **Anchors**: per *document*, ``min(num_anchors, eligible)`` positions drawn without replacement from
   its eligible ones (loss mask on at ``a`` and ``a+1``, both in the document), using a
   ``torch.Generator`` seeded from ``batch.seed`` (reproducible; the loader's seed changes with the epoch,
   so anchors are re-drawn every epoch). This is the DFlash recipe's "512 anchors per sequence", also
   when several documents share a row. Only real blocks are computed: no padding blocks.
2. **Blocks**: block ``n`` is ``[x_a, MASK x (B-1)]`` at document positions ``p_a .. p_a + B-1``.
3. **Loss**: CE of block row ``k`` (1..B-1) against token ``a+k`` (same position, no shift); a row counts
   only if ``a+k`` is in the anchor's document and on the loss mask. Each counted row is weighted by a
   :class:`PositionWeighting` (``train.loss_weighting``): :class:`ExpDecayWeighting`, the reference recipe's
   ``exp(-(k-1)/gamma)``, as a weighted mean over all counted rows of the batch; or :class:`DPaceWeighting`
   (D-PACE), weights from the drafter's own detached per-row confidence, summed per block and averaged over
   the blocks. The full-vocabulary logits exist for at most ``chunk_rows`` rows at a time
   (:class:`ChunkedCrossEntropy`): memory is bounded whatever the batch and whichever weighting.
4. **Metrics**: accuracy per block position, and the exact acceptance length per block
   ``1 + (number of leading correct rows)`` (an uncounted row ends the run), averaged over blocks.

How many blocks a batch holds is bounded by the plan (``loader.max_block_positions``), so the loss's
scale per block is the recipe's; batches of short documents simply hold fewer documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..protocols import Drafter
from .attention import BlockLayout, global_doc_ids

# gamma of the loss weights exp(-(k-1)/gamma), as published for these block sizes.
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))
DEFAULT_CHUNK_ROWS = 2048


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


def sample_anchors(eligible: Tensor, docs: Tensor, num_anchors: int, generator: torch.Generator | None) -> Tensor:
    """Up to ``num_anchors`` eligible positions per document, without replacement, ascending.

    eligible [C] bool, docs [C] document ids (flat context) -> anchors [A] int64 (flat indices).
    The random keys are drawn on the CPU from ``generator`` so the draw is identical on any device."""
    C = eligible.shape[0]
    device = eligible.device
    keys = torch.rand(C, generator=generator, dtype=torch.float64).to(device)  # [C] in [0, 1)
    keys = torch.where(eligible, keys, torch.full_like(keys, 2.0))  # ineligible after the eligible ones
    order = (docs.to(torch.float64) * 4.0 + keys).argsort()  # grouped by document, random within it
    sorted_docs = docs[order]
    idx = torch.arange(C, device=device)
    starts = torch.ones(C, dtype=torch.bool, device=device)
    starts[1:] = sorted_docs[1:] != sorted_docs[:-1]
    rank = idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(0).values  # position within its document
    take = eligible[order] & (rank < num_anchors)
    return order[take].sort().values


def all_anchors(eligible: Tensor) -> Tensor:
    """Every eligible position (evaluation): eligible [C] -> anchors [A] ascending."""
    return eligible.nonzero().flatten()


@dataclass
class Blocks:
    """The block inputs and targets for a set of anchors."""

    layout: BlockLayout
    block_ids: Tensor  # [A, B] block input tokens: x_a then MASK
    block_positions: Tensor  # [A, B] document positions p_a + k
    targets: Tensor  # [A, B] token at a+k (row 0 unused)
    row_valid: Tensor  # [A, B] bool: row k counts (k >= 1, in the anchor's document, on the loss mask)

    def to(self, device: torch.device) -> Blocks:
        """The same blocks on ``device`` (the index work may run where the batch's token ids are)."""
        if self.targets.device == device:
            return self
        return Blocks(self.layout.to(device), self.block_ids.to(device), self.block_positions.to(device), self.targets.to(device),
                      self.row_valid.to(device))


@dataclass
class FlatBatch:
    """A batch's per-token tensors flattened over rows (C = R*T positions)."""

    input_ids: Tensor  # [C]
    loss_mask: Tensor  # [C] bool
    docs: Tensor  # [C] document ids unique across rows (-1 padding)
    positions: Tensor  # [C] position within the document
    eligible: Tensor  # [C] bool: may anchor a block
    row_tokens: int  # T: positions per row of the batch

    @classmethod
    def of(cls, batch: BatchLike) -> FlatBatch:
        eligible = eligible_anchors(batch.loss_mask, batch.doc_ids).reshape(-1)
        return cls(batch.input_ids.reshape(-1).long(), batch.loss_mask.reshape(-1).bool(),
                   global_doc_ids(batch.doc_ids), batch.position_ids.reshape(-1).long(), eligible,
                   int(batch.input_ids.shape[1]))


def build_blocks(flat: FlatBatch, anchors: Tensor, block_size: int, mask_token_id: int) -> Blocks:
    """The blocks at ``anchors`` [A] (flat indices into ``flat``)."""
    C, B = flat.input_ids.shape[0], block_size
    device = flat.input_ids.device
    k = torch.arange(B, device=device)  # [B]
    idx = anchors.unsqueeze(-1) + k  # [A, B]
    idx_c = idx.clamp(max=C - 1)
    targets = flat.input_ids[idx_c]  # [A, B]
    same_doc = (idx < C) & (flat.docs[idx_c] == flat.docs[anchors].unsqueeze(-1))
    row_valid = same_doc & flat.loss_mask[idx_c] & (k > 0)
    block_ids = torch.full((anchors.shape[0], B), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = flat.input_ids[anchors]
    block_positions = flat.positions[anchors].unsqueeze(-1) + k  # [A, B]
    layout = BlockLayout(anchors=anchors, ctx_doc=flat.docs, ctx_pos=flat.positions, block_size=B,
                         row_tokens=flat.row_tokens)
    return Blocks(layout, block_ids, block_positions, targets, row_valid)


def loss_weights(block_size: int, gamma: float, device: torch.device) -> Tensor:
    """[B] weights: 0 for the anchor row, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(confidence: Tensor, row_valid: Tensor, alpha: float) -> Tensor:
    """D-PACE position weights [A, B] from the drafter's confidence in each row's target, confidence [A, B].

    With the smoothed confidence ``s_i = (1 - alpha) * q_i + alpha`` of each counted row and ``s_i = 1`` for
    the others (an uncounted row neither breaks nor shortens the product), row ``j`` of a block weighs
    ``w_j = sum over counted rows m >= j of prod_{i <= m} s_i`` (0 for uncounted rows): the expected number of
    accepted draft tokens that still depend on row ``j`` being right, if each row were accepted with
    probability ``s_i``. Each block's weights depend on that block's rows only."""
    valid = row_valid.to(confidence.dtype)  # [A, B]
    smooth = torch.where(row_valid, (1.0 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = smooth.cumprod(dim=-1)  # [A, B]: prod_{i <= m} s_i
    return (prefix * valid).flip(-1).cumsum(-1).flip(-1) * valid  # suffix sums over counted rows


class PositionWeighting(Protocol):
    """How the counted rows' cross-entropies combine into the loss (``train.loss_weighting``)."""

    def weigh(self, ce: Tensor, rows: Tensor, row_valid: Tensor) -> tuple[Tensor, Tensor]:
        """``(weights [N], denominator [])`` of the loss ``sum(weights * ce) / denominator``, given the counted
        rows' detached cross-entropies ce [N] at flat indices ``rows`` [N] of the blocks' row_valid [A, B]."""
        ...


@dataclass(frozen=True)
class ExpDecayWeighting:
    """The reference recipe: row k weighs exp(-(k-1)/gamma); the loss is the weighted mean over counted rows."""

    gamma: float

    def weigh(self, ce: Tensor, rows: Tensor, row_valid: Tensor) -> tuple[Tensor, Tensor]:
        w = loss_weights(row_valid.shape[1], self.gamma, ce.device) * row_valid  # [A, B]
        return w.reshape(-1)[rows], w.sum()


@dataclass(frozen=True)
class DPaceWeighting:
    """D-PACE: :func:`dpace_weights` of the drafter's detached confidence ``q = exp(-CE)`` in each target; the
    loss is the weighted CE summed over each block's rows and averaged over the blocks (not divided by the sum
    of the weights, which would cancel the credit mass the weights carry)."""

    alpha: float

    def weigh(self, ce: Tensor, rows: Tensor, row_valid: Tensor) -> tuple[Tensor, Tensor]:
        confidence = torch.ones(row_valid.shape, dtype=torch.float32, device=ce.device)  # [A, B]
        confidence.view(-1)[rows] = torch.exp(-ce.float())
        w = dpace_weights(confidence, row_valid, self.alpha)  # [A, B]
        return w.reshape(-1)[rows], torch.tensor(float(row_valid.shape[0]), device=ce.device)


# ----------------------------------------------------------------------------------------------
# The chunked loss head
# ----------------------------------------------------------------------------------------------


def head_operands(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(hidden, weight)`` in the loss head's compute dtype: autocast's when it is on for their device (the
    frozen lm_head is stored in it, bf16, so no copy of it is made), else ``hidden``'s. Never an fp32 copy
    of the lm_head under autocast, whatever dtype ``hidden`` arrives in."""
    dtype = hidden.dtype
    try:
        if torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
    except RuntimeError:  # a device autocast does not know (meta)
        pass
    return hidden.to(dtype), weight if weight.dtype == dtype else weight.to(dtype)


def _chunk_logits(h: Tensor, weight: Tensor) -> Tensor:
    """[c, H] @ [V, H]^T -> fp32 logits [c, V] (the matmul in h's dtype, fp32 from there on)."""
    return (h @ weight.t()).float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-row CE(hidden_i @ weight^T, target_i) and the greedy prediction of each row, computed ``chunk`` rows
    at a time: the full-vocabulary logits of all rows never exist at once.

    The gradient of each row's CE with respect to its hidden row, ``(softmax - onehot) @ weight``, is computed
    chunk by chunk during the forward (when ``hidden`` requires it) and kept, [N, H], until backward scales
    row i by dLoss/dCE_i. So the weights the caller puts on the rows may depend on the CE values themselves
    (D-PACE) and still cost no second pass over the vocabulary. ``weight`` (the frozen lm_head) gets no
    gradient. Logits are formed in the compute dtype (:func:`head_operands`); the softmax, log-sum-exp and CE
    run in fp32."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        N = hidden.shape[0]
        h_mat, w_mat = head_operands(hidden, weight)  # [N, H], [V, H] in the compute dtype
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        ce = torch.empty(N, dtype=torch.float32, device=hidden.device)
        pred = torch.empty(N, dtype=torch.long, device=hidden.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            z = _chunk_logits(h_mat[s:e], w_mat)  # [c, V] fp32
            tgt = targets[s:e].unsqueeze(1)  # [c, 1]
            pred[s:e] = z.argmax(-1)
            z_tgt = z.gather(1, tgt).squeeze(1)  # [c]
            z_max = z.amax(-1, keepdim=True)  # [c, 1]
            z.sub_(z_max).exp_()  # in place: exp(z - max)
            sum_exp = z.sum(-1, keepdim=True)  # [c, 1]
            ce[s:e] = sum_exp.log().squeeze(1) + z_max.squeeze(1) - z_tgt  # log-sum-exp - target logit
            if grad is not None:
                z.div_(sum_exp)  # softmax
                z.scatter_add_(1, tgt, torch.full_like(z_tgt, -1.0).unsqueeze(1))  # softmax - onehot
                grad[s:e] = z.to(w_mat.dtype) @ w_mat  # [c, H]
            del z
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx: Any, grad_ce: Tensor, grad_pred: Tensor | None) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors  # [N, H]
        return grad * grad_ce.unsqueeze(1).to(grad.dtype), None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor,
                          chunk: int = DEFAULT_CHUNK_ROWS) -> tuple[Tensor, Tensor]:
    """``(CE per row [N] fp32, argmax [N])`` of hidden [N, H] through ``weight`` [V, H] against targets [N]."""
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk)


@torch.no_grad()
def chunked_argmax(hidden: Tensor, weight: Tensor, chunk: int = DEFAULT_CHUNK_ROWS) -> Tensor:
    """Greedy predictions [N] of hidden [N, H], ``chunk`` rows of logits at a time."""
    hidden, w_mat = head_operands(hidden, weight)
    return torch.cat([_chunk_logits(hidden[s:s + chunk], w_mat).argmax(-1)
                      for s in range(0, hidden.shape[0], chunk)]) if hidden.shape[0] else \
        torch.empty(0, dtype=torch.long, device=hidden.device)


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def block_metrics(pred: Tensor, blocks: Blocks) -> dict[str, Tensor]:
    """Exact per-batch metrics from greedy predictions pred [A, B] (row k predicts token a+k).

    Returns detached tensors; the sums make aggregation across batches exact:
      n_blocks, accepted_sum (sum over blocks of leading correct rows), position_correct [B-1],
      position_count [B-1], acceptance_length (1 + accepted_sum / n_blocks), accuracy_per_position [B-1]."""
    correct = (pred == blocks.targets) & blocks.row_valid  # [A, B]
    run = correct[:, 1:].long().cumprod(dim=-1)  # [A, B-1]: 1 while every row so far was right
    return finalize_metrics({
        "n_blocks": torch.tensor(correct.shape[0], device=pred.device),
        "accepted_sum": run.sum().detach(),
        "position_correct": correct[:, 1:].sum(0).detach(),
        "position_count": blocks.row_valid[:, 1:].sum(0).detach(),
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


# ----------------------------------------------------------------------------------------------
# Putting it together
# ----------------------------------------------------------------------------------------------


def forward_blocks(model: Drafter, batch: BatchLike, flat: FlatBatch, anchors: Tensor) -> tuple[Tensor, Blocks]:
    """Run the drafter on the blocks at ``anchors`` [A]: final hidden states [A, B, H] and the blocks (on the
    features' device; the index work runs where ``flat`` is)."""
    cfg = model.config
    return run_blocks(model, batch, build_blocks(flat, anchors, cfg.block_size, cfg.mask_token_id))


def layer_features(model: Drafter, features: Tensor) -> Tensor:
    """The drafter's input [R, T, n*H] of cache features: a cache extracted with ``cache.store_final_hidden``
    adds the teacher's final normed state as a last H-wide slot (for the distribution losses), left out here."""
    width = len(model.config.target_layer_ids) * int(model.config.hidden_size)
    return features[..., :width] if features.shape[-1] == width + int(model.config.hidden_size) else features


def run_blocks(model: Drafter, batch: BatchLike, blocks: Blocks) -> tuple[Tensor, Blocks]:
    """The drafter's final hidden states [A, B, H] for ``blocks``, moved to the features' device first."""
    blocks = blocks.to(batch.features.device)
    features = layer_features(model, batch.features)  # [R, T, n*H]
    return model(features, blocks.block_ids, blocks.block_positions, blocks.layout), blocks


@torch.no_grad()
def predict_blocks(model: Drafter, batch: BatchLike, flat: FlatBatch, anchors: Tensor,
                   chunk: int = DEFAULT_CHUNK_ROWS) -> tuple[Tensor, Blocks]:
    """Greedy drafts [A, B] at ``anchors`` (row k predicts token a+k) and the blocks."""
    hidden, blocks = forward_blocks(model, batch, flat, anchors)
    if hasattr(model, "select_greedy"):  # DFlash2: the selector's teacher-forced greedy path (train.models.dflash2)
        return model.select_greedy(hidden, blocks, chunk), blocks
    A, B, H = hidden.shape
    pred = chunked_argmax(hidden.reshape(A * B, H), model.lm_head, chunk).view(A, B)
    return pred, blocks


def dflash_loss(model: Drafter, batch: BatchLike, *, num_anchors: int = 512,
                weighting: PositionWeighting | None = None, generator: torch.Generator | None = None,
                chunk_rows: int = DEFAULT_CHUNK_ROWS) -> LossOutput:
    """The training loss and metrics of one batch. ``weighting`` defaults to the reference recipe's exp-decay
    with :func:`default_gamma`; ``generator`` to one seeded with ``batch.seed``."""
    B = model.config.block_size
    weighting = ExpDecayWeighting(default_gamma(B)) if weighting is None else weighting
    if generator is None:
        generator = torch.Generator().manual_seed(int(batch.seed))
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, generator)  # [A]
    if anchors.numel() == 0:
        return _empty_loss(model, B)
    blocks = build_blocks(flat, anchors, B, model.config.mask_token_id)
    rows = blocks.row_valid.reshape(-1).nonzero().flatten()  # the counted rows only: [N]
    hidden, blocks = run_blocks(model, batch, blocks)  # [A, B, H]
    rows = rows.to(hidden.device)
    ce, pred_rows = chunked_cross_entropy(hidden.reshape(-1, hidden.shape[-1])[rows], model.lm_head,
                                          blocks.targets.reshape(-1)[rows], chunk_rows)  # [N], [N]
    w, denominator = weighting.weigh(ce.detach(), rows, blocks.row_valid)  # [N] detached, []
    loss = (ce * w).sum() / denominator.clamp(min=1e-6)
    pred = torch.full_like(blocks.targets, -1)  # uncounted rows never count as correct
    pred.view(-1)[rows] = pred_rows
    metrics = block_metrics(pred, blocks)
    metrics["loss"] = loss.detach()
    metrics["weight_sum"] = w.sum()
    return LossOutput(loss=loss, metrics=metrics)


def _empty_loss(model: Drafter, block_size: int) -> LossOutput:
    """A batch without any eligible anchor: loss 0 that still gives every parameter a (zero) gradient, so
    data-parallel ranks stay in step."""
    device = model.lm_head.device
    loss = sum((p.sum() * 0.0 for p in model.parameters() if p.requires_grad),
               torch.zeros((), device=device))
    zero = torch.zeros((), dtype=torch.long, device=device)
    metrics = finalize_metrics({"n_blocks": zero, "accepted_sum": zero,
                                "position_correct": torch.zeros(block_size - 1, dtype=torch.long, device=device),
                                "position_count": torch.zeros(block_size - 1, dtype=torch.long, device=device)})
    metrics["loss"] = loss.detach()
    metrics["weight_sum"] = torch.zeros((), device=device)
    return LossOutput(loss=loss, metrics=metrics)

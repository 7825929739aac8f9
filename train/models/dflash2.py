"""DFlash2: DFlash plus block-local dynamic convolutions and a low-rank candidate selector.

The architecture and checkpoint contract are those of the reference ``DFlash2DraftModel``:

* **Grouped dynamic causal convolution** (:class:`GroupedDynamicConv`), before and after each attention and MLP
  sublayer. ``prepare(x)`` projects the sublayer's normed input to two sets of dynamic taps
  ``[2, K, G]`` per position (``kernel_projection``), convolves ``x`` with the first set plus the learned base
  kernel ``base_kernel[0]`` ([K, H], one tap per channel) and hands back the second set; ``finish(y, taps)``
  convolves the sublayer's output with it plus ``base_kernel[1]``. Output position ``t`` of group ``g``
  (``conv_group_size`` channels) is ``sum_o (base[o] + dyn[t, o, g]) * x[t - o]``. It is causal and
  **block-local**: ``x[t - o]`` is zero when ``t - o`` lies before the start of ``t``'s block, so in the flat
  training layout (blocks of B rows back to back) no block sees another, exactly as at inference where the
  drafter sees one block.
* **Candidate selector** (:class:`CandidateSelector`): of the unary logits' top-K candidates ``c_j`` of a block
  row, each is rescored ``u_j + <P[prev] * W h, S[c_j]>`` with the row's final hidden state ``h``, the previous
  token ``prev`` (rank-``r`` codebooks ``P``, ``S``, projection ``W``). Inference walks the block left to right,
  each chosen token being the next row's ``prev`` (the block's first ``prev`` is its anchor token), greedily or
  by sampling ``softmax(scores / T)`` over the K candidates.

Training (:func:`dflash2_loss`) adds ``train.selector_alpha`` x the selector loss to the unary loss: per counted
row, the CE of the true token among the rescored top-K, with the **true** previous token as ``prev`` (teacher
forcing: while every earlier row is right this is exactly the inference walk, so the teacher-forced τ of the
selected path equals its greedy τ). The row's selector CE takes the row's unary weight. A true token outside the
top-K is ``train.selector_gold_outside``: ``drop`` (no selector loss for that row) or ``append`` (scored as an
extra candidate). ``train.selector_detach_backbone`` stops the selector loss at the hidden states and unary logits.

Full-vocabulary logits exist for at most ``chunk_rows`` rows at a time (:class:`UnaryTopK`), as in the DFlash
loss; the top-K candidates' logits carry their gradient back through their own rows of the frozen lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .model import DFlashConfig, DFlashDrafter, _autocast_on
from .objective import (
    DEFAULT_CHUNK_ROWS,
    BatchLike,
    Blocks,
    ExpDecayWeighting,
    FlatBatch,
    LossOutput,
    PositionWeighting,
    _empty_loss,
    block_metrics,
    build_blocks,
    default_gamma,
    head_operands,
    run_blocks,
    sample_anchors,
)

# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def block_shift(x: Tensor, offset: int, block_size: int) -> Tensor:
    """x [1, A*B, ...] (A blocks of B rows) -> x shifted ``offset`` rows later within each block, zeros first."""
    if offset == 0:
        return x
    blocks = x.reshape(-1, block_size, *x.shape[2:])  # [A, B, ...]
    shifted = torch.zeros_like(blocks)
    shifted[:, offset:] = blocks[:, :-offset]
    return shifted.reshape(x.shape)


def grouped_dynamic_conv(x: Tensor, taps: Tensor, base: Tensor, group_size: int, block_size: int) -> Tensor:
    """x [1, L, H], taps [1, L, K, G] (dynamic, per output position), base [K, H] -> [1, L, H], block-local."""
    _, L, H = x.shape
    G = H // group_size
    K = base.shape[0]
    xg = x.view(1, L, G, group_size)
    out = torch.zeros_like(xg)
    for o in range(K):
        if o >= block_size:
            break
        shifted = block_shift(xg, o, block_size)  # [1, L, G, gs]: x[t - o] within the block
        out = out + base[o].to(x.dtype).view(1, 1, G, group_size) * shifted
        out = out + taps[:, :, o].unsqueeze(-1) * shifted
    return out.view(1, L, H)


class GroupedDynamicConv(nn.Module):
    """The reference's grouped dynamic causal convolution (``base_kernel``, ``kernel_projection``)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # identity at tap 0 and a zero dynamic part: a fresh DFlash2 drafter computes what DFlash would
        nn.init.zeros_(self.base_kernel)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        """x [1, L, H] (normed sublayer input) -> (convolved x [1, L, H], taps for ``finish`` [1, L, K, G])."""
        _, L, H = x.shape
        taps = self.kernel_projection(x).view(1, L, 2, self.kernel_size, H // self.group_size)
        return grouped_dynamic_conv(x, taps[:, :, 0], self.base_kernel[0], self.group_size, block_size), taps[:, :, 1]

    def finish(self, y: Tensor, taps: Tensor, block_size: int) -> Tensor:
        """y [1, L, H] (sublayer output) -> convolved with ``taps`` and ``base_kernel[1]``."""
        return grouped_dynamic_conv(y, taps, self.base_kernel[1], self.group_size, block_size)


class CandidateSelector(nn.Module):
    """Rescoring of the unary top-K by a low-rank previous-token x candidate term conditioned on the hidden state."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = min(top_k, vocab_size)
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def pair_scores(self, hidden: Tensor, prev: Tensor, candidates: Tensor) -> Tensor:
        """hidden [N, H], prev [N], candidates [N, K] -> the bilinear term [N, K] (fp32)."""
        if not _autocast_on(hidden.device):
            hidden = hidden.to(self.hidden_projection.weight.dtype)
        query = self.predecessor_codebook(prev) * self.hidden_projection(hidden)  # [N, r]
        return torch.einsum("nr,nkr->nk", query.float(), self.successor_codebook(candidates).float())


class DFlash2Drafter(DFlashDrafter):
    """The DFlash drafter with a convolution pair per layer and the candidate selector."""

    def __init__(self, cfg: DFlashConfig, embed_tokens: Tensor, lm_head: Tensor, attention: str = "auto",
                 activation_checkpointing: bool = False):
        super().__init__(cfg, embed_tokens, lm_head, attention, activation_checkpointing)
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            layer.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)
        nn.init.normal_(self.candidate_selector.predecessor_codebook.weight, std=0.02)
        nn.init.normal_(self.candidate_selector.successor_codebook.weight, std=0.02)
        nn.init.normal_(self.candidate_selector.hidden_projection.weight, std=0.02)

    @torch.no_grad()
    def select_greedy(self, hidden: Tensor, blocks: Blocks, chunk: int = DEFAULT_CHUNK_ROWS) -> Tensor:
        """Teacher-forced greedy selection [A, B] (row 0: -1) from final hidden states [A, B, H]: each row's
        previous token is the true one, so a block's leading run of correct rows is its greedy acceptance."""
        A, B, H = hidden.shape
        rows = torch.arange(A * B, device=hidden.device).view(A, B)[:, 1:].reshape(-1)  # [A*(B-1)]
        h = hidden.reshape(-1, H)[rows]
        _, _, top_val, top_idx, _ = UnaryTopK.apply(h, self.lm_head, blocks.targets.reshape(-1)[rows],
                                                    self.candidate_selector.top_k, self.logit_transform_params(), chunk)
        prev = blocks.targets.reshape(-1)[rows - 1]
        scores = top_val + self.candidate_selector.pair_scores(h, prev, top_idx)  # [N, K]
        pred = torch.full((A * B,), -1, dtype=torch.long, device=hidden.device)
        pred[rows] = top_idx.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
        return pred.view(A, B)

    @torch.no_grad()
    def select_path(self, hidden: Tensor, anchor: int, temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> Tensor:
        """The inference walk over one block's rows 1..B-1: hidden [B-1, H] -> tokens [B-1]; each row's previous
        token is the one chosen for the row before (the anchor for the first). Greedy at temperature 0, else
        sampled from ``softmax(scores / temperature)`` over the row's K candidates."""

        def choose(scores: Tensor, _cand: Tensor) -> Tensor:  # scores [1, K] -> the chosen column [1]
            if temperature > 0:
                return torch.multinomial(torch.softmax(scores / temperature, -1), 1, generator=generator)[:, 0]
            return scores.argmax(-1)

        return self.walk(hidden, anchor, choose)

    def walk(self, hidden: Tensor, anchor: int, choose: Any) -> Tensor:
        """The selector's walk with a given rule: ``choose(scores [1, K], candidates [K]) -> column [1]`` picks
        each row's token among its unary top-K given the row before's. hidden [B-1, H] -> tokens [B-1]."""
        sel = self.candidate_selector
        unary, cand = self.logits(hidden).float().topk(sel.top_k, dim=-1)  # [B-1, K]
        prev = torch.tensor([anchor], device=hidden.device)
        path = []
        for row in range(hidden.shape[0]):
            scores = unary[row:row + 1] + sel.pair_scores(hidden[row:row + 1], prev, cand[row:row + 1])  # [1, K]
            j = choose(scores, cand[row]).to(cand.device)
            prev = cand[row:row + 1].gather(1, j.unsqueeze(1)).squeeze(1)  # [1]
            path.append(prev)
        return torch.cat(path)

    def logit_transform_params(self) -> tuple[float, float | None]:
        return float(self.config.output_multiplier), self.config.final_logit_softcapping


# ----------------------------------------------------------------------------------------------
# The chunked unary head with top-K
# ----------------------------------------------------------------------------------------------


def transform_logits(z: Tensor, multiplier: float, cap: float | None) -> Tensor:
    """The unary transform on fp32 logits: ``z * multiplier``, then ``cap * tanh(. / cap)``."""
    if multiplier != 1.0:
        z = z * multiplier
    return torch.tanh(z / cap) * cap if cap is not None else z


def transform_slope(t: Tensor, multiplier: float, cap: float | None) -> Tensor | float:
    """d transformed / d raw logit, from the transformed value ``t``: ``m`` or ``m (1 - (t / cap)^2)``."""
    return multiplier * (1.0 - (t / cap) ** 2) if cap is not None else multiplier


class UnaryTopK(torch.autograd.Function):
    """Per row of hidden [N, H]: the CE of its target under the transformed unary logits, the argmax, the top-K
    transformed logits and ids, and the target's transformed logit, ``chunk`` rows of logits at a time.

    Differentiable in ``hidden`` through the CE (its gradient is formed during the forward, as in
    ``ChunkedCrossEntropy``), the top-K values and the target logit (their gradient is a weighted sum of the
    candidates' lm_head rows, gathered a few block rows at a time in the backward: no second vocabulary-wide
    product)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, k: int,
                transform: tuple[float, float | None], chunk: int) -> tuple[Tensor, ...]:
        N = hidden.shape[0]
        mult, cap = transform
        hidden, w_mat = head_operands(hidden, weight)  # [N, H], [V, H]: never an fp32 lm_head copy under autocast
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        ce = torch.empty(N, dtype=torch.float32, device=hidden.device)
        pred = torch.empty(N, dtype=torch.long, device=hidden.device)
        top_val = torch.empty(N, k, dtype=torch.float32, device=hidden.device)
        top_idx = torch.empty(N, k, dtype=torch.long, device=hidden.device)
        gold = torch.empty(N, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            z = transform_logits((hidden[s:e] @ w_mat.t()).float(), mult, cap)  # [c, V] fp32
            tgt = targets[s:e].unsqueeze(1)  # [c, 1]
            top_val[s:e], top_idx[s:e] = z.topk(k, dim=-1)  # [c, K], best first
            pred[s:e] = top_idx[s:e, 0]
            gold[s:e] = z.gather(1, tgt).squeeze(1)
            lse = torch.logsumexp(z, dim=-1)  # [c]
            ce[s:e] = lse - gold[s:e]
            if grad is not None:
                p = (z - lse.unsqueeze(1)).exp_()  # softmax
                p.scatter_add_(1, tgt, torch.full_like(gold[s:e], -1.0).unsqueeze(1))  # softmax - onehot
                if cap is not None or mult != 1.0:
                    p = p * transform_slope(z, mult, cap)
                grad[s:e] = p.to(hidden.dtype) @ w_mat  # [c, H]
                del p
            del z
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0), w_mat, targets, top_val, top_idx,
                              gold)
        ctx.transform, ctx.chunk = transform, chunk
        ctx.mark_non_differentiable(pred, top_idx)
        return ce, pred, top_val, top_idx, gold

    @staticmethod
    def backward(ctx: Any, g_ce: Tensor | None, _g_pred: Any, g_top: Tensor | None, _g_idx: Any,
                 g_gold: Tensor | None) -> tuple[Tensor | None, ...]:
        grad_ce, w_mat, targets, top_val, top_idx, gold = ctx.saved_tensors
        mult, cap = ctx.transform
        N = top_val.shape[0]
        out = grad_ce * g_ce.unsqueeze(1).to(grad_ce.dtype) if g_ce is not None else torch.zeros_like(grad_ce)
        if g_top is None and g_gold is None:
            return out, None, None, None, None, None
        coef_top = (g_top.float() * transform_slope(top_val, mult, cap)) if g_top is not None else None  # [N, K]
        coef_gold = (g_gold.float() * transform_slope(gold, mult, cap)) if g_gold is not None else None  # [N]
        # d raw logit / d h is the candidate's lm_head row: gather the K rows of a few block rows at a time
        # (N K H work instead of a vocabulary-wide N V H product), at most a logits chunk's bytes at once
        V, H = w_mat.shape
        K = top_idx.shape[1]
        if 8 * K >= V:  # the candidates are much of a small vocabulary: one dense product per chunk is cheaper
            for s in range(0, N, ctx.chunk):
                e = min(N, s + ctx.chunk)
                dz = torch.zeros(e - s, V, dtype=torch.float32, device=out.device)  # [c, V]
                if coef_top is not None:
                    dz.scatter_add_(1, top_idx[s:e], coef_top[s:e])
                if coef_gold is not None:
                    dz.scatter_add_(1, targets[s:e].unsqueeze(1), coef_gold[s:e].unsqueeze(1))
                out[s:e] += dz.to(out.dtype) @ w_mat
            return out, None, None, None, None, None
        step = max(1, (ctx.chunk * V * 4) // (K * H * w_mat.element_size()))
        for s in range(0, N, step):
            e = min(N, s + step)
            if coef_top is not None:
                rows = torch.nn.functional.embedding(top_idx[s:e], w_mat)  # [n, K, H] (index_select: fast gather)
                out[s:e] += torch.bmm(coef_top[s:e].to(rows.dtype).unsqueeze(1), rows).squeeze(1).to(out.dtype)
                del rows
            if coef_gold is not None:
                gold_rows = torch.nn.functional.embedding(targets[s:e], w_mat).float()  # [n, H]
                out[s:e] += (coef_gold[s:e].unsqueeze(1) * gold_rows).to(out.dtype)
        return out, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# The loss and metrics
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectorLoss:
    """``train.selector_*``: the selector loss's weight, gold-outside-top-K rule and gradient stop."""

    alpha: float = 1.0
    gold_outside: str = "drop"  # "drop" | "append"
    detach_backbone: bool = False


def selector_scores(model: DFlash2Drafter, h: Tensor, prev: Tensor, top_val: Tensor, top_idx: Tensor,
                    gold: Tensor, gold_logit: Tensor, rule: SelectorLoss) -> tuple[Tensor, Tensor, Tensor]:
    """Rescored candidates and the gold column of each row: ``(scores [N, K'] fp32, gold_col [N], trains [N] bool)``.

    ``K' = K`` with ``drop`` (rows whose gold is outside the top-K do not train), ``K + 1`` with ``append`` (the
    extra column scores the gold token; -inf when the gold already is a candidate)."""
    if rule.detach_backbone:
        h, top_val, gold_logit = h.detach(), top_val.detach(), gold_logit.detach()
    sel = model.candidate_selector
    scores = top_val + sel.pair_scores(h, prev, top_idx)  # [N, K]
    hit = top_idx == gold.unsqueeze(1)  # [N, K]
    in_top = hit.any(-1)  # [N]
    gold_col = hit.float().argmax(-1)  # [N]: the gold's column where it is a candidate
    if rule.gold_outside == "drop":
        return scores, gold_col, in_top
    extra = gold_logit + sel.pair_scores(h, prev, gold.unsqueeze(1)).squeeze(1)  # [N]
    extra = torch.where(in_top, torch.full_like(extra, float("-inf")), extra)
    gold_col = torch.where(in_top, gold_col, torch.full_like(gold_col, scores.shape[1]))
    return torch.cat([scores, extra.unsqueeze(1)], dim=1), gold_col, torch.ones_like(in_top)


def selector_metric_sums(blocks: Blocks, rows: Tensor, chosen: Tensor, in_top: Tensor) -> dict[str, Tensor]:
    """Exact sums (aggregate across micro-batches and ranks by adding): per block position, the rows counted, the
    rows the teacher-forced selection got right, the rows whose gold is in the top-K; and the selected path's
    accepted rows summed over blocks."""
    A, B = blocks.targets.shape
    sel = torch.full((A * B,), -1, dtype=torch.long, device=chosen.device)
    sel[rows] = chosen
    top = torch.zeros(A * B, dtype=torch.bool, device=chosen.device)
    top[rows] = in_top
    correct = (sel.view(A, B) == blocks.targets) & blocks.row_valid  # [A, B]
    return {
        "sums/selector_correct": correct[:, 1:].sum(0).detach(),  # [B-1]
        "sums/selector_topk_hit": (top.view(A, B) & blocks.row_valid)[:, 1:].sum(0).detach(),  # [B-1]
        "sums/selector_rows": blocks.row_valid[:, 1:].sum(0).detach(),  # [B-1]
        "sums/selector_accepted": correct[:, 1:].long().cumprod(-1).sum().reshape(1).detach(),  # [1]
        "sums/selector_blocks": torch.tensor([A], device=chosen.device),  # [1]
    }


def selector_summary(sums: dict[str, Tensor], unary_tau: float | None = None) -> dict[str, float]:
    """The selector's TensorBoard scalars (docs/metrics.md) from summed ``sums/selector_*`` tensors."""
    rows = sums["sums/selector_rows"].double().clamp(min=1)
    out = {
        "selector/accuracy": float(sums["sums/selector_correct"].sum() / rows.sum()),
        "selector/topk_recall": float(sums["sums/selector_topk_hit"].sum() / rows.sum()),
        "selector/tau": 1.0 + float(sums["sums/selector_accepted"].sum()) / max(1.0, float(sums["sums/selector_blocks"].sum())),
    }
    if unary_tau is not None:
        out["selector/unary_tau"] = unary_tau
    for k, (c, t, n) in enumerate(zip(sums["sums/selector_correct"].tolist(), sums["sums/selector_topk_hit"].tolist(),
                                       rows.tolist(), strict=True), start=1):
        out[f"selector/acc_pos_{k}"] = c / n
        out[f"selector/recall_pos_{k}"] = t / n
    if "sums/selector_loss" in sums:
        out["selector/loss"] = float(sums["sums/selector_loss"].sum()) / max(1.0, float(sums["sums/selector_micro"].sum()))
    return out


def dflash2_loss(model: DFlash2Drafter, batch: BatchLike, *, num_anchors: int = 512,
                 weighting: PositionWeighting | None = None, generator: torch.Generator | None = None,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS, selector: SelectorLoss | None = None) -> LossOutput:
    """The DFlash2 training loss of one batch: the unary CE (weighted as in ``dflash_loss``, on the transformed
    logits) plus ``alpha`` x the selector CE, and the unary and selector metrics. A DFlash drafter (no selector)
    gets the unary part only: the path for ``output_multiplier`` / ``final_logit_softcapping``."""
    B = model.config.block_size
    weighting = ExpDecayWeighting(default_gamma(B)) if weighting is None else weighting
    selector = SelectorLoss() if selector is None else selector
    if generator is None:
        generator = torch.Generator().manual_seed(int(batch.seed))
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, generator)  # [A]
    has_selector = isinstance(model, DFlash2Drafter)
    if anchors.numel() == 0:
        out = _empty_loss(model, B)
        if has_selector:  # every rank sums the same metrics (data-parallel all-reduce)
            out.metrics.update(_zero_selector_sums(B, out.loss.device))
        return out
    blocks = build_blocks(flat, anchors, B, model.config.mask_token_id)
    rows = blocks.row_valid.reshape(-1).nonzero().flatten()  # the counted rows: [N]
    hidden, blocks = run_blocks(model, batch, blocks)  # [A, B, H]
    rows = rows.to(hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])[rows]  # [N, H]
    gold = blocks.targets.reshape(-1)[rows]  # [N]
    k = model.candidate_selector.top_k if has_selector else 1
    mult, cap = float(model.config.output_multiplier), model.config.final_logit_softcapping
    ce, pred_rows, top_val, top_idx, gold_logit = UnaryTopK.apply(h, model.lm_head, gold, k, (mult, cap), chunk_rows)
    w, denominator = weighting.weigh(ce.detach(), rows, blocks.row_valid)  # [N] detached, []
    denominator = denominator.clamp(min=1e-6)
    unary = (ce * w).sum() / denominator
    loss = unary
    pred = torch.full_like(blocks.targets, -1)
    pred.view(-1)[rows] = pred_rows
    metrics = block_metrics(pred, blocks)
    if has_selector:
        prev = blocks.targets.reshape(-1)[rows - 1]  # [N]: the true previous token (row 0 = the anchor)
        scores, gold_col, trains = selector_scores(model, h, prev, top_val, top_idx, gold, gold_logit, selector)
        sel_ce = torch.logsumexp(scores, -1) - scores.gather(1, gold_col.unsqueeze(1)).squeeze(1)  # [N]
        sel_loss = (torch.where(trains, sel_ce, torch.zeros_like(sel_ce)) * w).sum() / denominator
        loss = unary + selector.alpha * sel_loss
        chosen = top_idx.gather(1, scores[:, :top_idx.shape[1]].argmax(-1, keepdim=True)).squeeze(1)  # [N]
        metrics.update(selector_metric_sums(blocks, rows, chosen, (top_idx == gold.unsqueeze(1)).any(-1)))
        metrics["sums/selector_loss"] = sel_loss.detach().reshape(1)
        metrics["sums/selector_micro"] = torch.ones(1, device=hidden.device)
        metrics["unary_loss"] = unary.detach()
    metrics["loss"] = loss.detach()
    metrics["weight_sum"] = w.sum()
    return LossOutput(loss=loss, metrics=metrics)


def _zero_selector_sums(block_size: int, device: torch.device) -> dict[str, Tensor]:
    """The ``sums/selector_*`` metrics of a batch without blocks (same keys and shapes as a real batch's)."""
    per_position = torch.zeros(block_size - 1, dtype=torch.long, device=device)
    one = torch.zeros(1, device=device)
    return {"sums/selector_correct": per_position, "sums/selector_topk_hit": per_position.clone(),
            "sums/selector_rows": per_position.clone(), "sums/selector_accepted": one.long(),
            "sums/selector_blocks": one.long(), "sums/selector_loss": one, "sums/selector_micro": one + 1}


def uses_dflash2_loss(cfg: DFlashConfig) -> bool:
    """Whether a drafter trains through :func:`dflash2_loss`: DFlash2, or any drafter with a logit transform."""
    return cfg.arch == "dflash2" or cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping is not None


__all__ = ["CandidateSelector", "DFlash2Drafter", "GroupedDynamicConv", "SelectorLoss", "UnaryTopK", "dflash2_loss",
           "selector_summary", "uses_dflash2_loss"]

"""Distribution losses: the drafter against the teacher's whole next-token distribution, not only its token.

The teacher's distribution at a position is ``p = softmax(f @ W^T)``, ``f`` its final normed hidden state
(HF ``hidden_states[-1]``, stored in the cache as the last feature slot when extracted with
``cache.store_final_hidden``) and ``W`` the frozen lm_head that the drafter shares. Block row ``k`` of the
block anchored at ``a`` predicts token ``a+k``; the teacher predicted that token from position ``a+k-1``, so
the row's teacher state is ``f[a+k-1]``. With the drafter's ``q = softmax(h @ W^T)`` for the row, the
per-row losses (``train.loss``) are

* ``ce``: ``-log q[x]`` against the data token ``x`` (the default objective, :mod:`train.models.objective`);
* ``kl``: forward KL, ``sum_v p_v (log p_v - log q_v)``;
* ``tv``: total variation, ``TV = 1/2 sum_v |p_v - q_v|``;
* ``lk_alpha``: ``-log alpha`` with ``alpha = sum_v min(p_v, q_v) = 1 - TV``, the probability that
  speculative sampling accepts the row's draft (LK losses, arXiv 2602.23881): its gradient is TV's scaled by
  ``1/alpha``, strong from a cold start where TV's vanishes; at a one-hot ``p`` it is CE;
* ``lk_lambda``: ``lambda * KL + (1 - lambda) * TV`` with ``lambda = exp(-eta * sg[alpha])`` per row
  (``train.lk_eta``, 3 by default; ``sg``: no gradient through it): KL while the draft is far from the teacher,
  TV (acceptance) once it is close;

and a mix with CE, ``w * CE + (1 - w) * D`` (``train.loss_ce_weight = w``). The rows are combined by the
position weighting of :mod:`train.models.objective` (``exp_decay`` or ``dpace``); D-PACE's per-row confidence is
``alpha`` (``exp(-CE)`` for ``ce``), passed to it as ``-log alpha``.

Memory: :class:`ChunkedDistillation` forms both the drafter's and the teacher's full-vocabulary logits for
at most ``chunk`` rows at a time (never the teacher distribution of all block rows), computes each row's
loss and its gradient with respect to the row's hidden state in the same pass, and keeps only that gradient
``[N, H]`` for backward. Gradients with respect to the drafter logits ``z`` (``s = sign(q - p)``):
``dCE/dz = q - onehot(x)``, ``dKL/dz = q - p``, ``dTV/dz = q * (s - sum_v s_v q_v) / 2``,
``d(-log alpha)/dz = dTV/dz / alpha``, and for ``lk_lambda`` ``lambda * dKL/dz + (1 - lambda) * dTV/dz``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflash_cache.errors import ConfigError

from ..protocols import Drafter
from .objective import (
    DEFAULT_CHUNK_ROWS,
    ExpDecayWeighting,
    FlatBatch,
    LossOutput,
    PositionWeighting,
    _empty_loss,
    block_metrics,
    build_blocks,
    default_gamma,
    layer_features,
    run_blocks,
    sample_anchors,
)

DISTRIBUTION_LOSSES = ("kl", "tv", "lk_lambda", "lk_alpha")
ALPHA_FLOOR = 1e-8  # lk_alpha: -log(max(alpha, floor)); below the floor the row gives no gradient


@dataclass(frozen=True)
class DistributionLoss:
    """``train.loss`` (one of :data:`DISTRIBUTION_LOSSES`), its CE share ``ce_weight`` and LK's ``eta``."""

    kind: str
    ce_weight: float = 0.0
    eta: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTION_LOSSES:
            raise ConfigError(f"train.loss {self.kind!r} is not a distribution loss {list(DISTRIBUTION_LOSSES)}")


def check_loss_source(loss: str, spec: Any) -> None:
    """Before the first step: a distribution loss needs the teacher's final state in the cache."""
    if loss in DISTRIBUTION_LOSSES and not spec.final_hidden:
        raise ConfigError(
            f"train.loss = {loss!r} needs the teacher's distribution, computed from its final normed hidden state, "
            "which this cache does not hold: re-extract with --set cache.store_final_hidden=true (one hidden size "
            "more per token), or train with train.loss = \"ce\"")


def split_final_hidden(model: Drafter, features: Tensor) -> tuple[Tensor, Tensor | None]:
    """features [R, T, n*H (+H)] -> (the drafter's layer features [R, T, n*H], the final state [R, T, H] or
    None when the cache holds none)."""
    layers = layer_features(model, features)
    if layers.shape[-1] == features.shape[-1]:
        return features, None
    return layers, features[..., layers.shape[-1]:]


# ----------------------------------------------------------------------------------------------
# The chunked distribution head
# ----------------------------------------------------------------------------------------------


def _row_coefficients(kind: str, ce_weight: float, eta: float, kl: Tensor, tv: Tensor, alpha: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """``(distribution loss per row [c], coefficient of dKL/dz [c], coefficient of dTV/dz [c])``, the
    coefficients already scaled by ``1 - ce_weight``."""
    d = 1.0 - ce_weight
    zero = torch.zeros_like(kl)
    if kind == "kl":
        return kl, zero + d, zero
    if kind == "tv":
        return tv, zero, zero + d
    if kind == "lk_alpha":
        ok = alpha > ALPHA_FLOOR
        inv = torch.where(ok, 1.0 / alpha.clamp(min=ALPHA_FLOOR), zero)
        return -alpha.clamp(min=ALPHA_FLOOR).log(), zero, d * inv
    lam = torch.exp(-eta * alpha)  # lk_lambda, alpha detached (it is a plain number here)
    return lam * kl + (1.0 - lam) * tv, d * lam, d * (1.0 - lam)


def _softmax_(z: Tensor) -> Tensor:
    """In place: z [c, V] -> softmax(z); returns the log-sum-exp [c]."""
    m = z.amax(-1, keepdim=True)  # [c, 1]
    z.sub_(m).exp_()
    s = z.sum(-1, keepdim=True)  # [c, 1]
    z.div_(s)
    return (s.log() + m).squeeze(1)


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """sum_v a[i, v] * b[i, v] -> [c] in fp32 (never in autocast's bf16), without an [c, V] temporary."""
    off = torch.autocast(a.device.type, enabled=False) if a.device.type in ("cpu", "cuda") else nullcontext()
    with off:
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)


class ChunkedDistillation(torch.autograd.Function):
    """Per-row distribution loss of drafter rows ``hidden`` [N, H] against teacher rows ``teacher`` [N, H]
    through ``weight`` [V, H], ``chunk`` rows at a time. Returns ``(loss [N], -log alpha [N], argmax [N],
    alpha [N])``; only the loss is differentiable (w.r.t. ``hidden``). Logits are formed in ``hidden``'s
    dtype; everything after in fp32. At most four fp32 ``[chunk, V]`` buffers are alive at once."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, teacher: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                kind: str, ce_weight: float, eta: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        N = hidden.shape[0]
        w_mat = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)  # [V, H]
        t_rows = teacher if teacher.dtype == hidden.dtype else teacher.to(hidden.dtype)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        dev = hidden.device
        loss, nla, alpha_all = (torch.empty(N, dtype=torch.float32, device=dev) for _ in range(3))
        pred = torch.empty(N, dtype=torch.long, device=dev)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            zq = (hidden[s:e] @ w_mat.t()).float()  # [c, V] drafter logits
            zp = (t_rows[s:e] @ w_mat.t()).float()  # [c, V] teacher logits
            tgt = targets[s:e].unsqueeze(1)  # [c, 1]
            pred[s:e] = zq.argmax(-1)
            zq_tgt = zq.gather(1, tgt).squeeze(1)  # [c]
            p = zp.clone()
            lse_p = _softmax_(p)  # p [c, V]
            zp.sub_(zq)  # zp - zq
            p_dot = _rowdot(p, zp)  # sum p (zp - zq)
            del zp
            q = zq
            lse_q = _softmax_(q)  # in place: q = softmax(zq), computed as p is (equal logits: equal rows)
            kl = p_dot - lse_p + lse_q  # sum p (log p - log q)
            ce = lse_q - zq_tgt
            alpha = torch.minimum(p, q).sum(-1)  # [c]
            sgn = q - p  # [c, V]
            tv = 0.5 * torch.linalg.vector_norm(sgn, ord=1, dim=-1)
            d_loss, c_kl, c_tv = _row_coefficients(kind, ce_weight, eta, kl, tv, alpha)
            loss[s:e] = ce_weight * ce + (1.0 - ce_weight) * d_loss
            alpha_all[s:e] = alpha
            nla[s:e] = -alpha.clamp(min=ALPHA_FLOOR).log()
            if grad is not None:
                sgn.sign_()
                dtv = sgn.sub_(_rowdot(sgn, q).unsqueeze(1)).mul_(q).mul_(0.5)  # dTV/dz [c, V]
                g = q.mul_((c_kl + ce_weight).unsqueeze(1))  # (c_kl + w) q
                g.addcmul_(p, -c_kl.unsqueeze(1))  # - c_kl p
                g.addcmul_(dtv, c_tv.unsqueeze(1))  # + c_tv dTV/dz
                g.scatter_add_(1, tgt, torch.full((e - s, 1), -ce_weight, device=dev))  # - w onehot
                grad[s:e] = g.to(hidden.dtype) @ w_mat  # [c, H]
            del p, q, sgn
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        ctx.mark_non_differentiable(nla, pred, alpha_all)
        return loss, nla, pred, alpha_all

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors  # [N, H]
        return grad * grad_loss.unsqueeze(1).to(grad.dtype), None, None, None, None, None, None, None


def chunked_distillation(hidden: Tensor, teacher: Tensor, weight: Tensor, targets: Tensor, objective: DistributionLoss,
                         chunk: int = DEFAULT_CHUNK_ROWS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss [N], -log alpha [N], argmax [N], alpha [N])`` of drafter rows hidden [N, H] against teacher
    rows teacher [N, H] (see :class:`ChunkedDistillation`)."""
    return ChunkedDistillation.apply(hidden, teacher, weight, targets, chunk, objective.kind,
                                     float(objective.ce_weight), float(objective.eta))


# ----------------------------------------------------------------------------------------------
# The training loss of a batch
# ----------------------------------------------------------------------------------------------


def teacher_rows(final: Tensor, blocks: Any, rows: Tensor) -> Tensor:
    """The teacher's final state [N, H] for the counted rows ``rows`` (flat indices into [A, B]): row k of the
    block at flat anchor a reads position a + k - 1 (the teacher's prediction of token a + k)."""
    A, B = blocks.targets.shape
    k = torch.arange(B, device=final.device)
    src = (blocks.layout.anchors.to(final.device).unsqueeze(1) + k - 1).clamp(min=0).reshape(-1)  # [A*B]
    return final.reshape(-1, final.shape[-1])[src[rows]]


def distill_loss(model: Drafter, batch: Any, objective: DistributionLoss, *, num_anchors: int = 512,
                 weighting: PositionWeighting | None = None, generator: torch.Generator | None = None,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS) -> LossOutput:
    """The training loss and metrics of one batch under a distribution loss: the same anchors, blocks, position
    weighting and metrics as :func:`train.models.objective.dflash_loss`; adds ``alpha`` (the mean acceptance
    probability of the counted rows) to the metrics."""
    B = model.config.block_size
    weighting = ExpDecayWeighting(default_gamma(B)) if weighting is None else weighting
    if generator is None:
        generator = torch.Generator().manual_seed(int(batch.seed))
    _, final = split_final_hidden(model, batch.features)
    if final is None:
        raise ConfigError(f"train.loss = {objective.kind!r}: the batch has no teacher final state; re-extract with "
                          "--set cache.store_final_hidden=true")
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, generator)  # [A]
    if anchors.numel() == 0:
        out = _empty_loss(model, B)
        out.metrics["alpha"] = torch.zeros((), device=out.loss.device)
        return out
    blocks = build_blocks(flat, anchors, B, model.config.mask_token_id)
    rows = blocks.row_valid.reshape(-1).nonzero().flatten()  # [N]
    hidden, blocks = run_blocks(model, batch, blocks)  # [A, B, H]
    rows = rows.to(hidden.device)
    loss_rows, nla, pred_rows, alpha = chunked_distillation(
        hidden.reshape(-1, hidden.shape[-1])[rows], teacher_rows(final, blocks, rows), model.lm_head,
        blocks.targets.reshape(-1)[rows], objective, chunk_rows)  # [N] each
    w, denominator = weighting.weigh(nla, rows, blocks.row_valid)  # [N] detached, []
    loss = (loss_rows * w).sum() / denominator.clamp(min=1e-6)
    pred = torch.full_like(blocks.targets, -1)
    pred.view(-1)[rows] = pred_rows
    metrics = block_metrics(pred, blocks)
    metrics["loss"] = loss.detach()
    metrics["weight_sum"] = w.sum()
    metrics["alpha"] = alpha.mean() if alpha.numel() else torch.zeros((), device=alpha.device)
    return LossOutput(loss=loss, metrics=metrics)

"""Distribution losses (KL, TV, LK) against the teacher's distribution from its cached final state: each one
equals a dense reference (loss and every gradient), the chunked head is bounded, a cache without the final
state is refused before the first step, and a real run trains with them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fixtures.drafters import HIDDEN, tiny_batch, tiny_drafter
from fixtures.trainer import run_train, small_cache

from dflash_cache.errors import ConfigError
from train.components.memory import peak_memory_bytes
from train.components.metrics import read_metrics
from train.models.distill import (
    ALPHA_FLOOR,
    DistributionLoss,
    check_loss_source,
    chunked_distillation,
    distill_loss,
    split_final_hidden,
)
from train.models.objective import (
    DPaceWeighting,
    ExpDecayWeighting,
    FlatBatch,
    dflash_loss,
    dpace_weights,
    forward_blocks,
    loss_weights,
    sample_anchors,
)

KINDS = ["kl", "tv", "lk_lambda", "lk_alpha"]
BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.tokens_per_batch=512", "train.num_anchors=16"]


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Every element within 1e-5 of the gradient tensor's scale (its largest magnitude): fp32 round-off in
    sums over the vocabulary leaves ~1e-7 absolute noise on elements that nearly cancel."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= 1e-5 * scale, f"{what}: max error {err:.3g} vs gradient scale {scale:.3g}"


def dense_rows(zq: torch.Tensor, zp: torch.Tensor, targets: torch.Tensor, kind: str, w: float = 0.0,
               eta: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, alpha per row) from full logits [N, V] with plain autograd-able torch ops."""
    logq, logp = zq.float().log_softmax(-1), zp.float().log_softmax(-1)
    q, p = logq.exp(), logp.exp()
    ce = F.nll_loss(logq, targets, reduction="none")
    kl = (p * (logp - logq)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "kl":
        d = kl
    elif kind == "tv":
        d = tv
    elif kind == "lk_alpha":
        d = -alpha.clamp(min=ALPHA_FLOOR).log()
    else:
        lam = torch.exp(-eta * alpha.detach())
        d = lam * kl + (1 - lam) * tv
    return w * ce + (1 - w) * d, alpha


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("w", [0.0, 0.5])
def test_chunked_head_equals_the_dense_loss_and_gradient(kind, w):
    g = torch.Generator().manual_seed(1)
    N, H, V = 37, 16, 50
    h0, f = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)
    W = torch.randn(V, H, generator=g) * 0.5
    f[:5] = h0[:5]  # a few rows where teacher and drafter agree (alpha near 1)
    targets, row_w = torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g)
    h_ref = h0.clone().requires_grad_(True)
    ref, ref_alpha = dense_rows(h_ref @ W.t(), f @ W.t(), targets, kind, w, eta=2.0)
    (ref * row_w).sum().backward()
    obj = DistributionLoss(kind, w, eta=2.0)
    for chunk in (1, 8, 1000):
        h = h0.clone().requires_grad_(True)
        rows, nla, pred, alpha = chunked_distillation(h, f, W, targets, obj, chunk)
        total = (rows * row_w).sum()
        total.backward()
        ref_total = (ref * row_w).sum().item()
        assert abs(total.item() - ref_total) <= 1e-6 * abs(ref_total), (chunk, total.item(), ref_total)
        assert_grad_close(h.grad, h_ref.grad, f"chunk {chunk}")
        torch.testing.assert_close(alpha, ref_alpha, rtol=1e-5, atol=1e-7)
        assert torch.equal(pred, (h0 @ W.t()).argmax(-1))
        torch.testing.assert_close(nla, -ref_alpha.log(), rtol=1e-5, atol=1e-6)


def test_the_losses_are_what_their_names_say():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(30, 8, generator=g)
    f = torch.randn(4, 8, generator=g)
    t = torch.zeros(4, dtype=torch.long)
    for kind in KINDS:  # drafter == teacher: no loss (lk_alpha: -log 1), acceptance 1
        rows, _, _, alpha = chunked_distillation(f.clone(), f, W, t, DistributionLoss(kind))
        assert rows.abs().max().item() < 1e-5 and torch.allclose(alpha, torch.ones(4), atol=1e-5)
    h = torch.randn(4, 8, generator=g)
    tv = chunked_distillation(h, f, W, t, DistributionLoss("tv"))[0]
    alpha = chunked_distillation(h, f, W, t, DistributionLoss("tv"))[3]
    torch.testing.assert_close(tv, 1 - alpha, rtol=1e-5, atol=1e-6)  # alpha = 1 - TV
    lk = chunked_distillation(h, f, W, t, DistributionLoss("lk_alpha"))[0]
    torch.testing.assert_close(lk, -alpha.log())
    # eta -> 0: lk_lambda is KL; large eta with alpha > 0: TV
    kl = chunked_distillation(h, f, W, t, DistributionLoss("kl"))[0]
    torch.testing.assert_close(chunked_distillation(h, f, W, t, DistributionLoss("lk_lambda", eta=1e-9))[0], kl)
    torch.testing.assert_close(chunked_distillation(h, f, W, t, DistributionLoss("lk_lambda", eta=1e4))[0], tv,
                               rtol=1e-4, atol=1e-6)


def test_the_head_stays_fp32_under_bf16_autocast():
    # the logits matmuls run in bf16 under autocast; everything after them must stay fp32
    g = torch.Generator().manual_seed(3)
    h, f, W = torch.randn(9, 16, generator=g), torch.randn(9, 16, generator=g), torch.randn(40, 16, generator=g)
    t = torch.randint(0, 40, (9,), generator=g)
    hb, fb, Wb = (x.to(torch.bfloat16) for x in (h, f, W))
    for kind in KINDS:
        want, _ = dense_rows((hb @ Wb.t()).float(), (fb @ Wb.t()).float(), t, kind)  # bf16 logits, then fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = chunked_distillation(hb, fb, W.to(torch.bfloat16), t, DistributionLoss(kind), 4)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=kind)


def _final_batch(seed: int = 6):
    """tiny_batch plus a teacher final-state slot after the layer features."""
    batch = tiny_batch(rows=2, length=48, docs_per_row=2, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    final = torch.randn(2, 48, HIDDEN, generator=g).to(torch.bfloat16)
    batch.features = torch.cat([batch.features, final], -1)
    batch.loss_mask[:, 14] = False  # an uncounted row mid-block
    return batch


def _dense_reference(model, batch, kind: str, w: float, weighting: str, num_anchors: int = 8):
    """The whole batch loss with every counted row's drafter and teacher logits at once."""
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, torch.Generator().manual_seed(batch.seed))
    hidden, blocks = forward_blocks(model, batch, flat, anchors)  # [A, B, H]
    rows = blocks.row_valid.reshape(-1).nonzero().flatten()
    _, final = split_final_hidden(model, batch.features)
    zq = model.logits(hidden).flatten(0, 1)[rows]  # [N, V]
    # row k of the block anchored at flat position a targets the token at a + k, which the teacher predicted
    # from position a + k - 1 (written out here, not taken from the code under test)
    src = (anchors.unsqueeze(1) + torch.arange(model.block_size) - 1).flatten()[rows]  # [N]
    zp = final.flatten(0, 1)[src].float() @ model.lm_head.float().t()
    loss_rows, alpha = dense_rows(zq, zp, blocks.targets.flatten()[rows], kind, w)
    if weighting == "exp_decay":
        wts = (loss_weights(model.block_size, 7.0, zq.device) * blocks.row_valid).flatten()
        return (loss_rows * wts[rows]).sum() / wts.sum()
    conf = torch.ones(blocks.row_valid.shape)
    conf.view(-1)[rows] = alpha.detach()
    wts = dpace_weights(conf, blocks.row_valid, 0.3).flatten()
    return (loss_rows * wts[rows]).sum() / anchors.numel()


@pytest.mark.parametrize("kind,w", [("kl", 0.0), ("tv", 0.0), ("lk_lambda", 0.0), ("lk_alpha", 0.0), ("tv", 0.5)])
@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
def test_batch_loss_and_every_gradient_equal_the_dense_reference(kind, w, weighting):
    batch = _final_batch()
    ref_model, model = tiny_drafter(seed=9).train(), tiny_drafter(seed=9).train()
    ref = _dense_reference(ref_model, batch, kind, w, weighting)
    ref.backward()
    pw = ExpDecayWeighting(7.0) if weighting == "exp_decay" else DPaceWeighting(0.3)
    out = distill_loss(model, batch, DistributionLoss(kind, w), num_anchors=8, weighting=pw, chunk_rows=5)
    out.loss.backward()
    assert abs(out.loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        if q.grad is not None:
            assert_grad_close(p.grad, q.grad, name)
    assert 0 < out.metrics["alpha"].item() < 1


def _next_token_teacher_batch(seed: int = 6, scale: float = 100.0):
    """A batch whose teacher state at each position t is ``scale * lm_head[token t+1]``: its distribution there
    is (to e^-100) one-hot at the next token, so a distribution loss over these rows is the data CE -- the
    reference needs no row alignment from the code under test."""
    batch = tiny_batch(rows=2, length=48, docs_per_row=2, seed=seed)
    model = tiny_drafter(seed=9)
    nxt = torch.roll(batch.input_ids, -1, dims=1)  # [R, T] token t+1 (the last position's is never a target)
    final = (scale * model.lm_head.detach()[nxt]).to(torch.bfloat16)  # [R, T, H]
    batch.features = torch.cat([batch.features, final], -1)
    p = torch.softmax(final.float() @ model.lm_head.detach().float().t(), -1)  # [R, T, V]
    assert bool((p.argmax(-1) == nxt).all()) and p.amax(-1).min() > 1 - 1e-6  # the fixture is what it says
    return batch


@pytest.mark.parametrize("kind", ["kl", "lk_alpha"])
@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
def test_each_row_is_distilled_against_the_teacher_distribution_of_its_own_target_token(kind, weighting):
    """The teacher distribution used for a block row is the one the teacher gave for that row's target token:
    with a teacher certain of every next token, KL (and -log alpha) per row is the row's CE on the data token,
    so the batch loss equals the CE objective's. A teacher row shifted by one position is certain of another
    token and gives another loss."""
    batch = _next_token_teacher_batch()
    pw = (lambda: ExpDecayWeighting(7.0)) if weighting == "exp_decay" else (lambda: DPaceWeighting(0.3))
    ce = dflash_loss(tiny_drafter(seed=9), batch, num_anchors=8, weighting=pw())
    out = distill_loss(tiny_drafter(seed=9), batch, DistributionLoss(kind), num_anchors=8, weighting=pw(),
                       chunk_rows=5)
    assert abs(out.loss.item() - ce.loss.item()) <= 1e-4 * ce.loss.item(), (out.loss.item(), ce.loss.item())
    if kind == "lk_alpha":  # alpha = q[target]: the mean acceptance probability is exp(-CE) per row
        assert 0 < out.metrics["alpha"].item() < 1


def test_the_final_slot_never_reaches_the_drafter():
    # CE on a batch with the final-state slot = CE on the same batch without it
    batch = _final_batch()
    plain = tiny_batch(rows=2, length=48, docs_per_row=2, seed=6)
    plain.loss_mask[:, 14] = False
    model = tiny_drafter(seed=9)
    a, b = dflash_loss(model, batch, num_anchors=8), dflash_loss(model, plain, num_anchors=8)
    assert a.loss.item() == b.loss.item()
    with pytest.raises(ConfigError, match="store_final_hidden"):
        distill_loss(model, plain, DistributionLoss("kl"), num_anchors=8)


def test_the_head_never_holds_more_than_a_chunk_of_logits():
    hidden = torch.randn(512, 32, requires_grad=True)
    teacher, weight = torch.randn(512, 32), torch.randn(4096, 32)
    targets, w = torch.randint(0, 4096, (512,)), torch.rand(512)

    def run(chunk: int):
        rows = chunked_distillation(hidden, teacher, weight, targets, DistributionLoss("lk_lambda", 0.5), chunk)[0]
        (rows * w).sum().backward()

    small, _ = peak_memory_bytes(lambda: run(16))
    whole, _ = peak_memory_bytes(lambda: run(512))
    full_logits = 512 * 4096 * 4
    assert whole >= 2 * full_logits  # the teacher's and the drafter's at once
    assert small < full_logits / 4


def test_a_cache_without_the_final_state_is_refused_before_the_first_step(tmp_path):
    from dflash_cache import open_cache

    url = small_cache(str(tmp_path / "c"), n_samples=8)
    with pytest.raises(ConfigError, match="cache.store_final_hidden=true"):
        check_loss_source("kl", open_cache(url).spec)
    check_loss_source("ce", open_cache(url).spec)
    run = tmp_path / "run"
    proc = run_train(BASE, url, run, "train.loss=lk_alpha", "train.max_steps=2", expect=2)
    assert "store_final_hidden" in proc.stderr and "train.loss = 'lk_alpha'" in proc.stderr
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


@pytest.mark.parametrize("overrides", [("train.loss=lk_lambda",), ("train.loss=tv", "train.loss_ce_weight=0.5",
                                                                       "train.loss_weighting=dpace")])
def test_dflash_train_runs_a_distribution_loss(tmp_path, overrides):
    url = small_cache(str(tmp_path / "c"), n_samples=16, final_hidden=True)
    run = tmp_path / "run"
    run_train(BASE, url, run, *overrides, "train.max_steps=3")
    losses = [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(v) and v > 0 for v in losses)

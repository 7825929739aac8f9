"""Anchors, blocks, loss weights and exact acceptance metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fixtures.drafters import tiny_batch, tiny_drafter

from train.attention import BlockLayout
from train.objective import (
    Blocks,
    block_metrics,
    build_blocks,
    default_gamma,
    dflash_loss,
    eligible_anchors,
    forward_blocks,
    loss_weights,
    merge_metrics,
    sample_anchors,
)


def test_default_gamma_matches_the_published_values_and_interpolates():
    assert default_gamma(16) == 7.0 and default_gamma(10) == 5.0 and default_gamma(8) == 4.0
    assert default_gamma(12) == pytest.approx(5 + 2 / 3)
    assert default_gamma(4) == 2.0 and default_gamma(2) == 1.0
    assert default_gamma(32) == pytest.approx(7 + 16 / 3)


def test_loss_weights():
    w = loss_weights(8, 4.0, torch.device("cpu"))
    assert w[0] == 0
    assert torch.allclose(w[1:], torch.exp(-torch.arange(7.0) / 4.0))


def test_eligible_anchors_need_both_positions_in_one_document():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    # 1: (1,2) ok; 2: 3 is another document; 3: 4 off the mask; 5: (5,6) ok; 6: 7 is padding; 7: last
    assert eligible_anchors(loss_mask, doc_ids)[0].nonzero().flatten().tolist() == [1, 5]


def test_sample_anchors_are_eligible_unique_sorted_and_seeded():
    batch = tiny_batch(rows=3, length=64, docs_per_row=2)
    elig = eligible_anchors(batch.loss_mask, batch.doc_ids)
    elig[2] = False
    elig[2, [7, 40, 50]] = True  # row 2 has only 3 eligible positions
    a1, v1 = sample_anchors(elig, 10, torch.Generator().manual_seed(1))
    a2, v2 = sample_anchors(elig, 10, torch.Generator().manual_seed(1))
    a3, _ = sample_anchors(elig, 10, torch.Generator().manual_seed(2))
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert not torch.equal(a1, a3)  # another seed (epoch) draws other anchors
    assert a1.shape == (3, 10)
    assert v1.sum(1).tolist() == [10, 10, 3]
    assert a1[2, :3].tolist() == [7, 40, 50]
    for r in range(3):
        picked = a1[r][v1[r]]
        assert elig[r, picked].all()
        assert picked.unique().numel() == picked.numel()
        assert torch.equal(picked, picked.sort().values)


def test_sample_anchors_takes_every_eligible_position_when_there_are_few():
    elig = torch.zeros(1, 20, dtype=torch.bool)
    elig[0, [3, 9]] = True
    anchors, valid = sample_anchors(elig, 512, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[3, 9]] and valid.all()


def test_blocks_stop_at_document_end_and_loss_mask():
    batch = tiny_batch(rows=1, length=40, docs_per_row=2)  # docs 0..19, 20..39; prompt = 4 tokens each
    anchors = torch.tensor([[5, 16, 30]])
    blocks = build_blocks(batch, anchors, torch.ones_like(anchors, dtype=torch.bool), 8, 95)
    assert blocks.block_ids.view(3, 8)[:, 0].tolist() == batch.input_ids[0, [5, 16, 30]].tolist()
    assert (blocks.block_ids.view(3, 8)[:, 1:] == 95).all()
    assert blocks.block_positions.view(3, 8)[1].tolist() == list(range(16, 24))
    assert blocks.block_positions.view(3, 8)[2].tolist() == list(range(10, 18))  # doc 1 restarts at 0
    assert blocks.row_valid[0, 0].tolist() == [False] + [True] * 7
    assert blocks.row_valid[0, 1].tolist() == [False, True, True, True, False, False, False, False]
    assert torch.equal(blocks.targets[0, 0], batch.input_ids[0, 5:13])


def _blocks_for(targets: torch.Tensor, row_valid: torch.Tensor, valid: torch.Tensor) -> Blocks:
    R, N, B = targets.shape
    layout = BlockLayout(torch.zeros(R, N, dtype=torch.long), valid, torch.zeros(R, 4), B)
    return Blocks(layout, torch.zeros(R, N * B, dtype=torch.long), torch.zeros(R, N * B, dtype=torch.long),
                  targets, row_valid)


def test_acceptance_length_is_exact_not_a_product_of_marginals():
    B = 5
    targets = torch.zeros(1, 3, B, dtype=torch.long)
    pred = torch.tensor([[[9, 0, 0, 0, 0],     # all 4 right -> tau 5
                          [9, 0, 1, 0, 0],     # right, wrong, right, right -> tau 2
                          [9, 1, 0, 0, 0]]])   # wrong first -> tau 1
    row_valid = torch.ones(1, 3, B, dtype=torch.bool)
    row_valid[..., 0] = False
    m = block_metrics(pred, _blocks_for(targets, row_valid, torch.ones(1, 3, dtype=torch.bool)))
    assert m["n_blocks"].item() == 3
    assert m["acceptance_length"].item() == pytest.approx((5 + 2 + 1) / 3)
    assert m["accuracy_per_position"].tolist() == pytest.approx([2 / 3, 2 / 3, 1.0, 1.0])
    acc = m["accuracy_per_position"]
    marginal_tau = 1 + sum(math.prod(acc[: k + 1].tolist()) for k in range(B - 1))
    assert marginal_tau != pytest.approx(m["acceptance_length"].item())


def test_invalid_rows_end_the_run_and_invalid_blocks_do_not_count():
    targets = torch.zeros(1, 2, 4, dtype=torch.long)
    pred = torch.zeros(1, 2, 4, dtype=torch.long)  # everything "right"
    row_valid = torch.tensor([[[False, True, True, False], [False, True, True, True]]])
    valid = torch.tensor([[True, False]])
    m = block_metrics(pred, _blocks_for(targets, row_valid, valid))
    assert m["n_blocks"].item() == 1
    assert m["acceptance_length"].item() == 3.0  # rows 1, 2 right; row 3 is past the document
    assert m["position_count"].tolist() == [1, 1, 0]


def test_merge_metrics_is_exact():
    targets = torch.zeros(1, 1, 3, dtype=torch.long)
    rv = torch.tensor([[[False, True, True]]])
    v = torch.ones(1, 1, dtype=torch.bool)
    a = block_metrics(torch.zeros(1, 1, 3, dtype=torch.long), _blocks_for(targets, rv, v))  # tau 3
    b = block_metrics(torch.ones(1, 1, 3, dtype=torch.long), _blocks_for(targets, rv, v))  # tau 1
    m = merge_metrics(merge_metrics(None, a), b)
    assert m["acceptance_length"].item() == 2.0 and m["n_blocks"].item() == 2


def test_loss_is_the_weighted_mean_of_per_row_cross_entropy():
    model = tiny_drafter(seed=3)
    batch = tiny_batch(rows=2, length=40, docs_per_row=2, seed=1)
    out = dflash_loss(model, batch, num_anchors=6, gamma=3.0)
    g = torch.Generator().manual_seed(batch.seed)
    anchors, valid = sample_anchors(eligible_anchors(batch.loss_mask, batch.doc_ids), 6, g)
    with torch.no_grad():
        logits, blocks = forward_blocks(model, batch, anchors, valid)
    num, den = 0.0, 0.0
    for r, n, k in blocks.row_valid.nonzero().tolist():
        w = math.exp(-(k - 1) / 3.0)
        num += w * F.cross_entropy(logits[r, n, k], blocks.targets[r, n, k]).item()
        den += w
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)
    assert out.metrics["n_blocks"].item() == int(valid.sum())


def test_padding_rows_and_blocks_contribute_nothing():
    model = tiny_drafter(seed=3)
    batch = tiny_batch(rows=1, length=40, seed=2)
    padded = tiny_batch(rows=2, length=40, seed=2)
    for name in ("features", "input_ids", "loss_mask", "doc_ids", "position_ids"):
        getattr(padded, name)[0] = getattr(batch, name)[0]
    padded.loss_mask[1] = False
    padded.doc_ids[1] = -1
    a = dflash_loss(model, batch, num_anchors=8)
    b = dflash_loss(model, padded, num_anchors=8)
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-6)
    assert b.metrics["n_blocks"].item() == a.metrics["n_blocks"].item()


def test_a_batch_without_eligible_anchors_gives_zero_loss_with_a_gradient_path():
    model = tiny_drafter(seed=3).train()
    batch = tiny_batch(rows=1, length=20)
    batch.loss_mask[:] = False
    out = dflash_loss(model, batch)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.metrics["n_blocks"].item() == 0


def test_training_lowers_the_loss_and_never_touches_the_frozen_head():
    torch.manual_seed(0)
    model = tiny_drafter(seed=5).train()
    head = model.lm_head.clone()
    assert "lm_head" not in model.state_dict() and "embed_tokens" not in model.state_dict()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = tiny_batch(rows=2, length=48, seed=4)
    losses = []
    for _ in range(25):
        out = dflash_loss(model, batch, num_anchors=16)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert torch.equal(model.lm_head, head)

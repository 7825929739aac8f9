"""Anchors, blocks, loss weights and exact acceptance metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fixtures.drafters import tiny_batch, tiny_drafter

from train.components.memory import peak_memory_bytes
from train.models.attention import BlockLayout
from train.models.objective import (
    Blocks,
    DPaceWeighting,
    ExpDecayWeighting,
    FlatBatch,
    block_metrics,
    build_blocks,
    chunked_cross_entropy,
    default_gamma,
    dflash_loss,
    dpace_weights,
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


def _flat(batch):
    return FlatBatch.of(batch)


def test_sample_anchors_are_eligible_unique_sorted_and_seeded_per_document():
    batch = tiny_batch(rows=3, length=64, docs_per_row=2)
    flat = _flat(batch)
    elig = flat.eligible.clone()
    row2 = slice(128, 192)
    elig[row2] = False
    elig[[128 + 7, 128 + 40, 128 + 50]] = True  # row 2 has 3 eligible positions: 1 in doc 0, 2 in doc 1
    a1 = sample_anchors(elig, flat.docs, 10, torch.Generator().manual_seed(1))
    a2 = sample_anchors(elig, flat.docs, 10, torch.Generator().manual_seed(1))
    a3 = sample_anchors(elig, flat.docs, 10, torch.Generator().manual_seed(2))
    assert torch.equal(a1, a2)
    assert not torch.equal(a1, a3)  # another seed (epoch) draws other anchors
    assert elig[a1].all() and a1.unique().numel() == a1.numel() and torch.equal(a1, a1.sort().values)
    per_doc = torch.bincount(flat.docs[a1], minlength=6).tolist()
    assert per_doc == [10, 10, 10, 10, 1, 2]  # min(num_anchors, eligible) for every document
    assert a1[-3:].tolist() == [128 + 7, 128 + 40, 128 + 50]


def test_sample_anchors_takes_every_eligible_position_when_there_are_few():
    elig = torch.zeros(20, dtype=torch.bool)
    elig[[3, 9]] = True
    anchors = sample_anchors(elig, torch.zeros(20, dtype=torch.long), 512, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [3, 9]


def test_packed_short_documents_get_their_own_anchors():
    # one row holding 4 documents: anchors per row would have let the draw favour some of them;
    # per document every document gets min(num_anchors, eligible)
    batch = tiny_batch(rows=1, length=64, docs_per_row=4)  # 16 tokens each, 4-token prompts
    flat = _flat(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, 5, torch.Generator().manual_seed(3))
    assert torch.bincount(flat.docs[anchors]).tolist() == [5, 5, 5, 5]


def test_blocks_stop_at_document_end_and_loss_mask():
    batch = tiny_batch(rows=1, length=40, docs_per_row=2)  # docs 0..19, 20..39; prompt = 4 tokens each
    anchors = torch.tensor([5, 16, 30])
    blocks = build_blocks(_flat(batch), anchors, 8, 95)
    assert blocks.block_ids[:, 0].tolist() == batch.input_ids[0, [5, 16, 30]].tolist()
    assert (blocks.block_ids[:, 1:] == 95).all()
    assert blocks.block_positions[1].tolist() == list(range(16, 24))
    assert blocks.block_positions[2].tolist() == list(range(10, 18))  # doc 1 restarts at 0
    assert blocks.row_valid[0].tolist() == [False] + [True] * 7
    assert blocks.row_valid[1].tolist() == [False, True, True, True, False, False, False, False]
    assert torch.equal(blocks.targets[0], batch.input_ids[0, 5:13])


def test_blocks_never_run_into_the_next_row():
    batch = tiny_batch(rows=2, length=20)
    blocks = build_blocks(_flat(batch), torch.tensor([17]), 8, 95)  # row 0 ends at 19
    assert blocks.row_valid[0].tolist() == [False, True, True, False, False, False, False, False]


def _blocks_for(targets: torch.Tensor, row_valid: torch.Tensor) -> Blocks:
    A, B = targets.shape
    layout = BlockLayout(torch.zeros(A, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                         torch.arange(4), B)
    return Blocks(layout, torch.zeros(A, B, dtype=torch.long), torch.zeros(A, B, dtype=torch.long),
                  targets, row_valid)


def test_acceptance_length_is_exact_not_a_product_of_marginals():
    B = 5
    targets = torch.zeros(3, B, dtype=torch.long)
    pred = torch.tensor([[9, 0, 0, 0, 0],     # all 4 right -> tau 5
                         [9, 0, 1, 0, 0],     # right, wrong, right, right -> tau 2
                         [9, 1, 0, 0, 0]])    # wrong first -> tau 1
    row_valid = torch.ones(3, B, dtype=torch.bool)
    row_valid[..., 0] = False
    m = block_metrics(pred, _blocks_for(targets, row_valid))
    assert m["n_blocks"].item() == 3
    assert m["acceptance_length"].item() == pytest.approx((5 + 2 + 1) / 3)
    assert m["accuracy_per_position"].tolist() == pytest.approx([2 / 3, 2 / 3, 1.0, 1.0])
    acc = m["accuracy_per_position"]
    marginal_tau = 1 + sum(math.prod(acc[: k + 1].tolist()) for k in range(B - 1))
    assert marginal_tau != pytest.approx(m["acceptance_length"].item())


def test_invalid_rows_end_the_run():
    targets = torch.zeros(1, 4, dtype=torch.long)
    pred = torch.zeros(1, 4, dtype=torch.long)  # everything "right"
    row_valid = torch.tensor([[False, True, True, False]])
    m = block_metrics(pred, _blocks_for(targets, row_valid))
    assert m["n_blocks"].item() == 1
    assert m["acceptance_length"].item() == 3.0  # rows 1, 2 right; row 3 is past the document
    assert m["position_count"].tolist() == [1, 1, 0]


def test_merge_metrics_is_exact():
    targets = torch.zeros(1, 3, dtype=torch.long)
    rv = torch.tensor([[False, True, True]])
    a = block_metrics(torch.zeros(1, 3, dtype=torch.long), _blocks_for(targets, rv))  # tau 3
    b = block_metrics(torch.ones(1, 3, dtype=torch.long), _blocks_for(targets, rv))  # tau 1
    m = merge_metrics(merge_metrics(None, a), b)
    assert m["acceptance_length"].item() == 2.0 and m["n_blocks"].item() == 2


def _unchunked(model, batch, num_anchors: int, gamma: float):
    """The loss head without chunking: every counted row's full-vocabulary logits at once (the reference)."""
    flat = _flat(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, torch.Generator().manual_seed(batch.seed))
    hidden, blocks = forward_blocks(model, batch, flat, anchors)
    logits = model.logits(hidden)  # [A, B, V]
    w = loss_weights(model.block_size, gamma, logits.device) * blocks.row_valid
    ce = F.cross_entropy(logits.flatten(0, 1).float(), blocks.targets.flatten(), reduction="none")
    loss = (ce * w.flatten()).sum() / w.sum()
    return loss, block_metrics(logits.detach().argmax(-1), blocks), anchors, blocks


def test_loss_is_the_weighted_mean_of_per_row_cross_entropy():
    model = tiny_drafter(seed=3)
    batch = tiny_batch(rows=2, length=40, docs_per_row=2, seed=1)
    out = dflash_loss(model, batch, num_anchors=6, weighting=ExpDecayWeighting(3.0))
    with torch.no_grad():
        _, _, anchors, blocks = _unchunked(model, batch, 6, 3.0)
        hidden, _ = forward_blocks(model, batch, _flat(batch), anchors)
        logits = model.logits(hidden)
    num, den = 0.0, 0.0
    for n, k in blocks.row_valid.nonzero().tolist():
        w = math.exp(-(k - 1) / 3.0)
        num += w * F.cross_entropy(logits[n, k], blocks.targets[n, k]).item()
        den += w
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)
    assert out.metrics["n_blocks"].item() == anchors.numel() == 4 * 6


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_loss_equals_the_unchunked_loss_gradients_and_metrics(chunk):
    batch = tiny_batch(rows=2, length=48, docs_per_row=2, seed=6)
    ref_model, model = tiny_drafter(seed=9).train(), tiny_drafter(seed=9).train()
    ref_loss, ref_metrics, _, _ = _unchunked(ref_model, batch, 8, 7.0)
    ref_loss.backward()
    out = dflash_loss(model, batch, num_anchors=8, weighting=ExpDecayWeighting(7.0), chunk_rows=chunk)
    out.loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    for key in ("n_blocks", "accepted_sum", "position_correct", "position_count"):
        assert torch.equal(out.metrics[key], ref_metrics[key]), key


def _dpace_direct(confidence: list[list[float]], valid: list[list[bool]], alpha: float) -> list[list[float]]:
    """D-PACE weights written out from the formula, one block and one row at a time."""
    out = []
    for q, ok in zip(confidence, valid, strict=True):
        smooth = [(1 - alpha) * qi + alpha if oi else 1.0 for qi, oi in zip(q, ok, strict=True)]
        prefix = [math.prod(smooth[: m + 1]) for m in range(len(q))]
        out.append([sum(prefix[m] for m in range(j, len(q)) if ok[m]) if ok[j] else 0.0 for j in range(len(q))])
    return out


def test_dpace_weights_by_hand_and_against_the_formula():
    # one block, rows 1..3 counted with confidence 0.9, 0.5, 0.2, alpha 0.5: smoothed 0.95, 0.75, 0.6;
    # prefix products 0.95, 0.7125, 0.4275; each row's weight sums the prefixes from it to the block's end
    w = dpace_weights(torch.tensor([[0.3, 0.9, 0.5, 0.2]]), torch.tensor([[False, True, True, True]]), 0.5)
    assert w[0].tolist() == pytest.approx([0.0, 0.95 + 0.7125 + 0.4275, 0.7125 + 0.4275, 0.4275])
    # an uncounted row mid-block is transparent (factor 1, no term of its own) and weighs 0; alpha = 1: every
    # counted row's weight is the number of counted rows from it on, whatever the confidence
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(5, 8, generator=g)
    valid = torch.rand(5, 8, generator=g) > 0.3
    valid[:, 0] = False
    for alpha in (0.5, 1.0, 0.1):
        direct = torch.tensor(_dpace_direct(conf.tolist(), valid.tolist(), alpha))
        torch.testing.assert_close(dpace_weights(conf, valid, alpha), direct, rtol=1e-6, atol=0)
    counted_from_here = valid.flip(-1).cumsum(-1).flip(-1) * valid
    assert torch.equal(dpace_weights(conf, valid, 1.0), counted_from_here.float())


def _dpace_reference(model, batch, num_anchors: int, alpha: float):
    """The D-PACE loss with every counted row's full-vocabulary logits at once, weights from the formula."""
    flat = _flat(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, torch.Generator().manual_seed(batch.seed))
    hidden, blocks = forward_blocks(model, batch, flat, anchors)
    ce = F.cross_entropy(model.logits(hidden).flatten(0, 1).float(), blocks.targets.flatten(),
                         reduction="none").view_as(blocks.targets)  # [A, B]
    q = torch.exp(-ce.detach())
    w = torch.tensor(_dpace_direct(q.tolist(), blocks.row_valid.tolist(), alpha))  # detached: no gradient
    return (ce * w).sum() / anchors.numel(), w


@pytest.mark.parametrize("chunk", [1, 5, 64, 10_000])
def test_dpace_loss_and_gradients_match_a_direct_computation_whatever_the_chunk(chunk):
    batch = tiny_batch(rows=2, length=48, docs_per_row=2, seed=6)
    batch.loss_mask[:, 14] = False  # some blocks hold an uncounted row mid-block
    ref_model, model = tiny_drafter(seed=9).train(), tiny_drafter(seed=9).train()
    ref_loss, ref_w = _dpace_reference(ref_model, batch, 8, 0.3)
    ref_loss.backward()
    out = dflash_loss(model, batch, num_anchors=8, weighting=DPaceWeighting(0.3), chunk_rows=chunk)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert out.metrics["weight_sum"].item() == pytest.approx(ref_w.sum().item(), rel=1e-6)
    assert ref_w[:, 1].unique().numel() == ref_w.shape[0]  # row 1's weight differs per block: it follows confidence
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_dpace_weights_follow_the_drafter_not_the_batch_around_a_block():
    # a block's weights depend on its own rows only: scoring a document alone or next to another gives the
    # same per-block weight sum for it
    model = tiny_drafter(seed=3)
    both = tiny_batch(rows=2, length=40, seed=2)
    alone = tiny_batch(rows=1, length=40, seed=2)
    for name in ("features", "input_ids", "loss_mask", "doc_ids", "position_ids"):
        getattr(alone, name)[0] = getattr(both, name)[0]
    a = dflash_loss(model, alone, num_anchors=40, weighting=DPaceWeighting(0.5))  # every eligible anchor
    _, w_both = _dpace_reference(model, both, 40, 0.5)
    n_alone = a.metrics["n_blocks"].item()
    assert 0 < n_alone < w_both.shape[0]
    assert a.metrics["weight_sum"].item() == pytest.approx(w_both[:n_alone].sum().item(), rel=1e-6)


def test_chunked_cross_entropy_never_holds_more_than_a_chunk_of_logits():
    # the peak grows with the chunk, not with the number of rows: 16-row chunks of a 4096-token vocabulary
    # stay far below the 512 x 4096 fp32 logits an unchunked loss holds
    hidden = torch.randn(512, 32, requires_grad=True)
    weight, targets, w = torch.randn(4096, 32), torch.randint(0, 4096, (512,)), torch.rand(512)

    def run(chunk: int):
        ce, _ = chunked_cross_entropy(hidden, weight, targets, chunk)
        (ce * w).sum().backward()

    small, _ = peak_memory_bytes(lambda: run(16))
    whole, _ = peak_memory_bytes(lambda: run(512))
    full_logits = 512 * 4096 * 4
    assert whole >= full_logits
    assert small < full_logits / 8


def test_padding_rows_contribute_nothing():
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
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


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

"""SDPA (dense boolean mask) and FlexAttention (block mask) paths compute the same thing."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafters import tiny_batch, tiny_drafter

from train.attention import BlockLayout, flex_available
from train.objective import dflash_loss, eligible_anchors, sample_anchors

pytestmark = pytest.mark.skipif(not flex_available(), reason="FlexAttention needs torch >= 2.5")


def _mask_from_flex(layout: BlockLayout, causal: bool, window: int | None) -> torch.Tensor:
    bm = layout.flex(causal, window)
    R, N, B, T = layout.num_rows, layout.num_blocks, layout.block_size, layout.context_len
    b = torch.arange(R).view(R, 1, 1)
    q = torch.arange(N * B).view(1, -1, 1)
    kv = torch.arange(T + N * B).view(1, 1, -1)
    return torch.vmap(lambda bb, qq, kk: bm.mask_mod(bb, torch.tensor(0), qq, kk))(
        b.expand(R, N * B, T + N * B).flatten(), q.expand(R, -1, T + N * B).flatten(),
        kv.expand(R, N * B, -1).flatten()).view(R, 1, N * B, T + N * B)


@pytest.mark.parametrize("causal,window", [(False, None), (True, 6), (True, None)])
def test_flex_predicate_equals_dense_mask(causal, window):
    batch = tiny_batch(rows=2, length=32, docs_per_row=2, seed=3)
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(eligible_anchors(batch.loss_mask, batch.doc_ids), 5, g)
    valid[1, -1] = False
    layout = BlockLayout(anchors, valid, batch.doc_ids, block_size=4)
    assert torch.equal(_mask_from_flex(layout, causal, window), layout.dense(causal, window))


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_flex_and_sdpa_give_the_same_loss_and_metrics(layer_types):
    extra = {"layer_types": layer_types, "sliding_window": 12} if layer_types else {}
    sdpa = tiny_drafter(seed=4, attention="sdpa", **extra)
    flex = tiny_drafter(seed=4, attention="flex", **extra)
    batch = tiny_batch(rows=2, length=48, docs_per_row=2, seed=5)
    with torch.no_grad():  # FlexAttention has no CPU backward; the GPU test below covers it
        a = dflash_loss(sdpa, batch, num_anchors=6)
        b = dflash_loss(flex, batch, num_anchors=6)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.metrics["position_correct"], b.metrics["position_correct"])


@pytest.mark.gpu
def test_flex_and_sdpa_gradients_agree_on_cuda():
    sdpa = tiny_drafter(seed=4, attention="sdpa").cuda().train()
    flex = tiny_drafter(seed=4, attention="flex").cuda().train()
    batch = tiny_batch(rows=2, length=64, docs_per_row=2, seed=5)
    for name in ("features", "input_ids", "loss_mask", "doc_ids", "position_ids"):
        setattr(batch, name, getattr(batch, name).cuda())
    la = dflash_loss(sdpa, batch, num_anchors=8).loss
    lb = dflash_loss(flex, batch, num_anchors=8).loss
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sdpa.fc.weight.grad, flex.fc.weight.grad, rtol=1e-3, atol=1e-5)

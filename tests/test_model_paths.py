"""SDPA (dense boolean mask) and FlexAttention (block mask) paths compute the same thing."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafters import tiny_batch, tiny_drafter

from train.models.attention import BlockLayout, flex_available
from train.models.objective import FlatBatch, dflash_loss, sample_anchors

pytestmark = pytest.mark.skipif(not flex_available(), reason="FlexAttention needs torch >= 2.5")


def _mask_from_flex(layout: BlockLayout, within_block: str, window: int | None) -> torch.Tensor:
    bm = layout.flex(within_block, window)
    Q, K = layout.num_blocks * layout.block_size, layout.context_len + layout.num_blocks * layout.block_size
    q = torch.arange(Q).view(-1, 1).expand(Q, K).flatten()
    kv = torch.arange(K).view(1, -1).expand(Q, K).flatten()
    zero = torch.tensor(0)
    return torch.vmap(lambda qq, kk: bm.mask_mod(zero, zero, qq, kk))(q, kv).view(1, 1, Q, K)


@pytest.mark.parametrize("within_block,window", [("bidirectional", None), ("causal", 6), ("bidirectional", 6),
                                                  ("causal", None)])
def test_flex_predicate_equals_dense_mask(within_block, window):
    batch = tiny_batch(rows=2, length=32, docs_per_row=2, seed=3)
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, 5, torch.Generator().manual_seed(0))
    layout = BlockLayout(anchors, flat.docs, flat.positions, block_size=4)
    assert torch.equal(_mask_from_flex(layout, within_block, window), layout.dense(within_block, window))


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

"""The training mask, checked through the drafter's outputs (SDPA path)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fixtures.drafters import tiny_batch, tiny_drafter

from train.models.model import apply_rope
from train.models.objective import FlatBatch, build_blocks


def _run(model, batch, anchors, block_ids=None):
    """Block outputs [A, B, H] for flat ``anchors`` (single-row batches: flat index = position)."""
    flat = FlatBatch.of(batch)
    blocks = build_blocks(flat, torch.as_tensor(anchors), model.block_size, model.mask_token_id)
    ids = blocks.block_ids if block_ids is None else block_ids
    with torch.no_grad():
        out = model(batch.features, ids, blocks.block_positions, blocks.layout)
    return out, blocks


@pytest.fixture(scope="module")
def model():
    return tiny_drafter(seed=1)


def test_block_ignores_context_at_and_after_its_anchor(model):
    batch = tiny_batch(rows=1, length=40)
    a = 20
    ref, _ = _run(model, batch, [a])
    batch.features[0, a:] += 3.0  # positions >= a
    same, _ = _run(model, batch, [a])
    torch.testing.assert_close(same, ref, rtol=0, atol=0)


@pytest.mark.parametrize("pos", [0, 10, 19])
def test_block_sees_context_before_its_anchor(model, pos):
    batch = tiny_batch(rows=1, length=40)
    ref, _ = _run(model, batch, [20])
    batch.features[0, pos] += 3.0
    changed, _ = _run(model, batch, [20])
    assert (changed - ref).abs().max() > 1e-3


def test_blocks_do_not_see_each_other(model):
    batch = tiny_batch(rows=1, length=40)
    ref, blocks = _run(model, batch, [10, 20, 30])
    ids = blocks.block_ids.clone()
    B = model.block_size
    ids[1] = torch.arange(B) + 7  # every token of block 1 changes
    out, _ = _run(model, batch, [10, 20, 30], block_ids=ids)
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], rtol=0, atol=0)
    assert (out[1] - ref[1]).abs().max() > 1e-3


def test_rows_of_a_batch_do_not_see_each_other(model):
    batch = tiny_batch(rows=2, length=40, seed=3)
    ref, _ = _run(model, batch, [20, 40 + 20])  # the same position in row 0 and row 1
    batch.features[0] += 3.0  # all of row 0
    out, _ = _run(model, batch, [20, 40 + 20])
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)
    assert (out[0] - ref[0]).abs().max() > 1e-3


def test_full_attention_is_bidirectional_within_a_block(model):
    batch = tiny_batch(rows=1, length=40)
    ref, blocks = _run(model, batch, [20])
    ids = blocks.block_ids.clone()
    ids[0, -1] = 3  # the last row's token
    out, _ = _run(model, batch, [20], block_ids=ids)
    assert (out[0, 0] - ref[0, 0]).abs().max() > 1e-3  # the first row saw the last one


@pytest.mark.parametrize("rule", ["bidirectional", "causal"])
def test_sliding_layers_follow_the_configured_within_block_rule(rule):
    model = tiny_drafter(seed=2, layer_types=["sliding_attention", "sliding_attention"], sliding_window=64,
                         sliding_within_block=rule)
    batch = tiny_batch(rows=1, length=40)
    ref, blocks = _run(model, batch, [20])
    ids = blocks.block_ids.clone()
    ids[0, 5] = 3  # row 5 changes
    out, _ = _run(model, batch, [20], block_ids=ids)
    earlier = (out[0, :5] - ref[0, :5]).abs().max()
    if rule == "causal":
        assert earlier == 0  # earlier rows do not see it
    else:
        assert earlier > 1e-3  # the reference's rule: every row sees every other row
    assert (out[0, 5:] - ref[0, 5:]).abs().max() > 1e-3  # later rows do


def test_sliding_window_limits_context():
    model = tiny_drafter(seed=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    batch = tiny_batch(rows=1, length=40)
    # With window 4 the sliding layer sees only keys < 4 behind each row; the full layer sees all
    # context < a, so a far perturbation still reaches the output through the full layer only.
    sliding_only = tiny_drafter(seed=2, layer_types=["sliding_attention", "sliding_attention"], sliding_window=4)
    ref, _ = _run(sliding_only, batch, [20])
    batch.features[0, 5] += 3.0  # 15+ positions behind every row
    out, _ = _run(sliding_only, batch, [20])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    ref_full, _ = _run(model, tiny_batch(rows=1, length=40), [20])
    out_full, _ = _run(model, batch, [20])
    assert (out_full - ref_full).abs().max() > 1e-3


def test_packed_documents_do_not_see_each_other(model):
    batch = tiny_batch(rows=1, length=40, docs_per_row=2)  # doc 0: 0..19, doc 1: 20..39
    ref, _ = _run(model, batch, [30])
    batch.features[0, :20] += 3.0  # all of document 0 (before the anchor, but another document)
    same, _ = _run(model, batch, [30])
    torch.testing.assert_close(same, ref, rtol=0, atol=0)
    batch.features[0, 25] += 3.0  # document 1, before the anchor
    changed, _ = _run(model, batch, [30])
    assert (changed - ref).abs().max() > 1e-3


def test_a_block_at_a_document_start_sees_only_itself_and_is_finite(model):
    batch = tiny_batch(rows=1, length=40, docs_per_row=2)
    out, _ = _run(model, batch, [0, 20])  # both anchors start a document: no context at all
    assert torch.isfinite(out).all()
    batch.features += 3.0  # no context is visible to either block
    same, _ = _run(model, batch, [0, 20])
    torch.testing.assert_close(same, out, rtol=0, atol=0)


def test_rope_uses_each_documents_own_positions(model):
    # The same document at the start of a row and packed after another one gives the same block output.
    single = tiny_batch(rows=1, length=40)
    packed = tiny_batch(rows=1, length=40, docs_per_row=2)
    for name in ("features", "input_ids"):
        getattr(packed, name)[0, 20:] = getattr(single, name)[0, :20]
    a, _ = _run(model, single, [12])
    b, _ = _run(model, packed, [32])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _reference_forward(model, batch, anchor: int) -> torch.Tensor:
    """The drafter's block rows at one anchor of a single-document row, written from the rule itself: a
    dense mask where a block row sees the context strictly before the anchor and (sliding layers) less than
    ``window`` positions behind it, and every row of its own block. Returns [B, H]."""
    cfg, B = model.config, model.block_size
    feats = batch.features[0, :anchor].float()  # only the context before the anchor can matter
    ctx = model.hidden_norm(model.fc(feats))  # [P, H]
    ids = torch.full((B,), cfg.mask_token_id)
    ids[0] = batch.input_ids[0, anchor]
    h = model.embed(ids, torch.float32)  # [B, H]
    pos_ctx, pos_blk = torch.arange(anchor), anchor + torch.arange(B)
    rope = {n: model.rotary_emb(p, torch.float32) for n, p in (("ctx", pos_ctx), ("blk", pos_blk))}
    for i, layer in enumerate(model.layers):
        at = layer.self_attn
        x = layer.input_layernorm(h)
        q = at.q_norm(at.q_proj(x).view(B, at.num_heads, -1)).transpose(0, 1)  # [Hq, B, d]
        kc = at.k_norm(at.k_proj(ctx).view(anchor, at.num_kv_heads, -1)).transpose(0, 1)
        kb = at.k_norm(at.k_proj(x).view(B, at.num_kv_heads, -1)).transpose(0, 1)
        vc = at.v_proj(ctx).view(anchor, at.num_kv_heads, -1).transpose(0, 1)
        vb = at.v_proj(x).view(B, at.num_kv_heads, -1).transpose(0, 1)
        q = apply_rope(q.unsqueeze(0), *rope["blk"])[0]
        k = torch.cat([apply_rope(kc.unsqueeze(0), *rope["ctx"])[0], apply_rope(kb.unsqueeze(0), *rope["blk"])[0]], 1)
        v = torch.cat([vc, vb], 1)
        rep = at.num_heads // at.num_kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        sliding = cfg.layer_type(i) == "sliding_attention"
        allowed = torch.zeros(B, anchor + B, dtype=torch.bool)
        for r in range(B):
            for key in range(anchor):  # context: before the anchor, within the window for sliding layers
                allowed[r, key] = not sliding or (anchor + r) - key < cfg.sliding_window
            allowed[r, anchor:] = True  # all positions of the block see each other
        scores = (q @ k.transpose(1, 2)) / math.sqrt(at.head_dim)
        att = F.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v  # [Hq, B, d]
        h = h + at.o_proj(att.transpose(0, 1).reshape(B, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def test_27b_layer_types_equal_a_direct_dense_mask_computation_of_the_rule():
    # the Qwen3.6-27B preset's layer pattern (4 sliding + 1 full) with a window shorter than the context
    model = tiny_drafter(seed=7, num_hidden_layers=5, sliding_window=9,
                         layer_types=["sliding_attention"] * 4 + ["full_attention"])
    batch = tiny_batch(rows=1, length=40, seed=8)
    out, _ = _run(model, batch, [15, 31])
    for n, a in enumerate((15, 31)):
        with torch.no_grad():
            ref = _reference_forward(model, batch, a)
        torch.testing.assert_close(model.logits(out[n]), model.logits(ref), rtol=1e-4, atol=1e-4)

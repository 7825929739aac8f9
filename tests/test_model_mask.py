"""The training mask, checked through the drafter's outputs (SDPA path)."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafters import tiny_batch, tiny_drafter

from train.objective import build_blocks


def _run(model, batch, anchors, valid=None, block_ids=None):
    anchors = torch.as_tensor(anchors).view(1, -1)
    valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else torch.as_tensor(valid).view(1, -1)
    blocks = build_blocks(batch, anchors, valid, model.block_size, model.mask_token_id)
    ids = blocks.block_ids if block_ids is None else block_ids
    with torch.no_grad():
        out = model(batch.features, ids, batch.position_ids, blocks.block_positions, blocks.layout)
    B = model.block_size
    return out.view(1, anchors.shape[1], B, -1)[0], blocks  # [N, B, H]


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
    ids[0, B:2 * B] = torch.arange(B) + 7  # every token of block 1 changes
    out, _ = _run(model, batch, [10, 20, 30], block_ids=ids)
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], rtol=0, atol=0)
    assert (out[1] - ref[1]).abs().max() > 1e-3


def test_full_attention_is_bidirectional_within_a_block(model):
    batch = tiny_batch(rows=1, length=40)
    ref, blocks = _run(model, batch, [20])
    ids = blocks.block_ids.clone()
    ids[0, -1] = 3  # the last row's token
    out, _ = _run(model, batch, [20], block_ids=ids)
    assert (out[0, 0] - ref[0, 0]).abs().max() > 1e-3  # the first row saw the last one


def test_sliding_window_layers_are_causal_within_a_block():
    model = tiny_drafter(seed=2, layer_types=["sliding_attention", "sliding_attention"], sliding_window=64,
                         sliding_within_block="causal")
    batch = tiny_batch(rows=1, length=40)
    ref, blocks = _run(model, batch, [20])
    ids = blocks.block_ids.clone()
    ids[0, 5] = 3  # row 5 changes
    out, _ = _run(model, batch, [20], block_ids=ids)
    torch.testing.assert_close(out[0, :5], ref[0, :5], rtol=0, atol=0)  # earlier rows do not see it
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


def test_padding_blocks_produce_finite_outputs(model):
    batch = tiny_batch(rows=1, length=40)
    out, _ = _run(model, batch, [0, 20], valid=[False, True])  # anchor 0 would see no context at all
    assert torch.isfinite(out).all()


def test_rope_uses_each_documents_own_positions(model):
    # The same document at the start of a row and packed after another one gives the same block output.
    single = tiny_batch(rows=1, length=40)
    packed = tiny_batch(rows=1, length=40, docs_per_row=2)
    for name in ("features", "input_ids"):
        getattr(packed, name)[0, 20:] = getattr(single, name)[0, :20]
    a, _ = _run(model, single, [12])
    b, _ = _run(model, packed, [32])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

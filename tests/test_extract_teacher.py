"""Teacher feature capture: hooks match output_hidden_states exactly and stop after the deepest layer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_cache.config import CacheConfig
from dflash_cache.errors import ConfigError
from extract.teacher import (
    LayerCapture,
    capture_features,
    capture_features_and_argmax,
    decoder_layers,
    default_layer_ids,
    resolve_layer_ids,
)


@pytest.fixture(scope="module")
def model(tiny_teacher_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 700, (3, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding
    return ids, mask


def test_default_layer_ids():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(6, 3) == [1, 2, 3]
    assert default_layer_ids(28, 1) == [1]
    with pytest.raises(ConfigError, match="num_target_layers"):
        default_layer_ids(6, 4)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_moe", "llama"])
def test_captured_layer_k_equals_hidden_states_k_plus_1(arch):
    """Every layer id, the last included (HF's hidden_states[L] is after the final norm), for every
    tiny teacher family; with and without the logits, and on the argmax path."""
    from extract.tiny import resolve_tiny_teacher

    model = AutoModelForCausalLM.from_pretrained(resolve_tiny_teacher(arch=arch)).eval()
    ids, mask = _batch()
    layer_ids = list(range(len(decoder_layers(model))))
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    h = model.config.get_text_config().hidden_size
    feats, logits = capture_features(model, ids, mask, layer_ids)
    assert feats.shape == (3, 21, len(layer_ids) * h) and logits is None
    for i, k in enumerate(layer_ids):
        assert torch.equal(feats[..., i * h:(i + 1) * h], hs[k + 1]), k
    for only in ([layer_ids[-1]], [0, layer_ids[-1]]):
        assert torch.equal(capture_features(model, ids, mask, only, with_logits=True)[0][..., -h:], hs[-1])
        assert torch.equal(capture_features_and_argmax(model, ids, mask, only)[0][..., -h:], hs[-1])


def test_stops_after_deepest_layer_and_forms_no_logits(model):
    ran = []
    handles = [layer.register_forward_hook(lambda m, i, o, k=k: ran.append(k))
               for k, layer in enumerate(decoder_layers(model))]
    head_calls = []
    handles.append(model.lm_head.register_forward_hook(lambda *a: head_calls.append(1)))
    try:
        ids, mask = _batch()
        capture_features(model, ids, mask, [1, 2])
        assert ran == [0, 1, 2] and head_calls == []
        ran.clear()
        _, logits = capture_features(model, ids, mask, [1, 2], with_logits=True)
        assert ran == list(range(6)) and head_calls == [1]
        assert torch.equal(logits, model(input_ids=ids, attention_mask=mask).logits)
        ran.clear()
        head_calls.clear()
        capture_features(model, ids, mask, [5])  # the last layer: the decoder's normed output, still no logits
        assert ran == list(range(6)) and head_calls == []
    finally:
        for hd in handles:
            hd.remove()


def test_argmax_path_matches_full_logits(model):
    ids, mask = _batch()
    feats, argmax = capture_features_and_argmax(model, ids, mask, [1, 3])
    ref_feats, logits = capture_features(model, ids, mask, [1, 3], with_logits=True)
    assert torch.equal(feats, ref_feats)
    assert torch.equal(argmax, logits.argmax(-1))


def test_layer_capture_context_usage(model):
    ids, mask = _batch()
    with LayerCapture(model, [3]) as cap:
        model(input_ids=ids, attention_mask=mask)  # stops early inside; the context swallows it
    assert cap.features().shape == (3, 21, 128)


def test_layer_ids_out_of_range_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"out of range .* 6 decoder layers"):
        resolve_layer_ids(CacheConfig(target_layer_ids=[1, 6]), 6)
    with pytest.raises(ConfigError, match="strictly increasing"):
        resolve_layer_ids(CacheConfig(target_layer_ids=[3, 1]), 6)


def test_gpu_groups_for_a_teacher_spanning_several_gpus():
    from dflash_cache.errors import ConfigError
    from extract.teacher import rank_gpu_group

    assert [rank_gpu_group(r, 4, 8) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_gpu_group(0, 1, 8) == list(range(8))
    assert rank_gpu_group(2, 3, 6) == [4, 5]
    with pytest.raises(ConfigError, match="equal groups"):
        rank_gpu_group(0, 3, 8)

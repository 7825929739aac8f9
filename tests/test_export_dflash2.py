"""An exported DFlash2 drafter: the reference's architecture name, ``dflash_config`` fields and tensor names; the
shipped ``dflash.py`` computes the training model's block logits and its selector walks (greedy and sampled), and
decodes losslessly against a teacher."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.drafters import tiny_batch
from safetensors import safe_open
from test_export_hf import _greedy, _prompts, _teacher_drafter
from test_model_dflash2 import dflash2_drafter
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from train.models.dflash2 import DFlash2Drafter
from train.models.factory import load_drafter_dir
from train.models.model import read_drafter_config
from train.models.objective import FlatBatch, build_blocks
from train.tools.export import cli_main, export_drafter

TRANSFORM = dict(output_multiplier=1.25, final_logit_softcapping=6.0)


def _export(model, out, dtype: str = "float32"):
    return export_drafter(model.state_dict(), model.config, out, dtype=dtype)


def _head(model) -> torch.nn.Linear:
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight.data = model.lm_head.clone()
    return head


def test_export_writes_the_reference_contract(tmp_path):
    model = dflash2_drafter(**TRANSFORM, layer_types=["sliding_attention", "full_attention"], sliding_window=12)
    out = _export(model, tmp_path / "e")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
    assert cfg["is_causal"] is False  # sliding layers stay bidirectional within the block in the reference too
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 2, 3], "block_size": 8,
                                    "conv_kernel_size": 3, "conv_group_size": 16, "selector_top_k": 8,
                                    "selector_rank": 4, "sliding_within_block": "bidirectional", "causal": False,
                                    **TRANSFORM}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names
    assert not any(n.endswith("codebook.weight") for n in names)
    # the drafter directory reads back: same config, same weights under the module names
    assert read_drafter_config(out) == model.config
    again = load_drafter_dir(out, (model.embed_tokens, model.lm_head), attention="sdpa")
    assert isinstance(again, DFlash2Drafter)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    assert cli_main([str(out), "--out", str(tmp_path / "again"), "--dtype", "float32"]) == 0
    assert (tmp_path / "again" / "config.json").read_bytes() == (out / "config.json").read_bytes()


def test_shipped_model_computes_the_training_logits_and_selector_walks(tmp_path):
    model = dflash2_drafter(**TRANSFORM)
    draft = AutoModel.from_pretrained(str(_export(model, tmp_path / "e")), trust_remote_code=True,
                                      dtype=torch.float32).eval()
    assert type(draft).__name__ == "DFlash2DraftModel"
    loaded = draft.state_dict()
    assert torch.equal(loaded["candidate_selector.successor_codebook"],
                       model.candidate_selector.successor_codebook.weight)
    batch = tiny_batch(rows=1, length=48, seed=6)
    head = _head(model)
    B = model.block_size
    for a in (9, 30):
        blocks = build_blocks(FlatBatch.of(batch), torch.tensor([a]), B, model.mask_token_id)
        with torch.no_grad():
            want_h = model(batch.features, blocks.block_ids, blocks.block_positions, blocks.layout)  # [1, B, H]
            h = draft(position_ids=torch.arange(0, a + B).unsqueeze(0), noise_embedding=model.embed(blocks.block_ids),
                      target_hidden=batch.features[:, :a])  # [1, B, H]
            torch.testing.assert_close(draft.compute_logits(h, head), model.logits(want_h), rtol=1e-4, atol=1e-4)
            anchor = blocks.block_ids[:, 0]
            tokens, cand, q = draft.propose(h[:, 1:], anchor, head, 0.0)
            assert q is None and cand.shape == (1, B - 1, 8)
            assert torch.equal(tokens[0], model.select_path(want_h[0, 1:], int(anchor)))
            g1, g2 = torch.Generator().manual_seed(a), torch.Generator().manual_seed(a)
            tokens, cand, q = draft.propose(h[:, 1:], anchor, head, 0.7, generator=g1)
            assert torch.equal(tokens[0], model.select_path(want_h[0, 1:], int(anchor), 0.7, generator=g2))
            # the sampling distribution of row 1: softmax over the K rescored candidates at T = 0.7
            sel = model.candidate_selector
            z = model.logits(want_h[0, 1])
            vals, top = z.topk(8)
            pair = (sel.predecessor_codebook.weight[int(anchor)] * sel.hidden_projection(want_h[0, 1])
                    * sel.successor_codebook.weight[top]).sum(-1)
            torch.testing.assert_close(q[0, 0], torch.softmax((vals + pair) / 0.7, -1), rtol=1e-4, atol=1e-5)
            assert torch.equal(cand[0, 0], top)


@pytest.fixture(scope="module")
def teacher(tiny_teacher_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_teacher_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_teacher_dir))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spec_generate_with_the_selector(tmp_path, teacher, temperature):
    """Greedy: exactly the teacher's greedy output. Sampled (T = 1): the selector samples its drafts; the run
    produces the budget of valid tokens."""

    model, tokenizer = teacher
    base = _teacher_drafter(model, arch="dflash2", conv_group_size=16, selector_top_k=16, selector_rank=4,
                            **TRANSFORM)
    drafter = DFlash2Drafter(base.config, base.embed_tokens, base.lm_head, attention="sdpa").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    draft = AutoModel.from_pretrained(str(_export(drafter, tmp_path / "e")), trust_remote_code=True,
                                      dtype="auto").eval()
    torch.manual_seed(0)
    for ids in _prompts(tokenizer, 2):
        got = draft.spec_generate(target=model, input_ids=ids, max_new_tokens=24, stop_token_ids=None,
                                  temperature=temperature, return_stats=True)
        if temperature == 0.0:
            assert torch.equal(got.output_ids, _greedy(model, ids, 24, -1)[:, :ids.shape[1] + 24])
        assert got.num_output_tokens == 24
        assert int(got.output_ids.max()) < model.config.vocab_size
        assert all(1 <= n <= drafter.block_size for n in got.acceptance_lengths)

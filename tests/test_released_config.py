"""Warm starts from released drafters: a released ``config.json`` means in training what it means in the reference.

The oracle below is the DFlash reference's forward (the ``dflash`` 0.1.0 package's ``DFlashDraftModel`` and
``dflash_generate``), written out by hand from its rules and independent of ``train/models``: a layer is causal
within the block when the top-level ``is_causal`` says so (absent: sliding layers causal, full layers
bidirectional), a sliding layer sees keys less than ``sliding_window`` positions away (both sides unless causal),
and the block's embeddings are multiplied by ``dflash_config.input_embedding_scale``. Each released-style config
is loaded through ``model.init_from`` (``build_drafter``, what ``dflash-train`` calls), must give the oracle's
block logits, trains a step, and exports a directory whose ``config.json`` keeps the rule and whose weights,
under the oracle and under the shipped ``dflash.py``, give the trained model's logits. Configs that ask for
something this trainer does not implement are refused by name.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fixtures.drafters import HIDDEN, N_LAYERS_CAPTURED, VOCAB, tiny_batch, tiny_head
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from dflash_cache.errors import ConfigError
from train.config import ModelConfig
from train.models.factory import build_drafter
from train.models.objective import FlatBatch, build_blocks, dflash_loss
from train.tools.export import export_drafter

HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, BLOCK, WINDOW, MASK = 4, 2, 16, 128, 2, 8, 6, VOCAB - 1


def released_config(**top) -> dict:
    """A released-style DFlash ``config.json`` (Qwen3 fields, one sliding and one full layer, no key of ours)."""
    dflash_config = top.pop("dflash_config", {})
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 2, 3], **dflash_config},
        "dtype": "float32", "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": HIDDEN,
        "intermediate_size": MLP, "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 4096, "model_type": "qwen3", "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS, "num_target_layers": 6, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": WINDOW, "tie_word_embeddings": False,
        "use_cache": True, "use_sliding_window": True, "vocab_size": VOCAB,
    }
    cfg.update(top)
    return cfg


def released_weights(seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the released tensor names and shapes (written out here, not asked of the model)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + w(n, std=0.1)

    out = {"fc.weight": w(HIDDEN, N_LAYERS_CAPTURED * HIDDEN, std=0.05), "hidden_norm.weight": norm(HIDDEN),
           "norm.weight": norm(HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN), p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": norm(HEAD_DIM), p + "self_attn.k_norm.weight": norm(HEAD_DIM),
            p + "mlp.gate_proj.weight": w(MLP, HIDDEN), p + "mlp.up_proj.weight": w(MLP, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, MLP), p + "input_layernorm.weight": norm(HIDDEN),
            p + "post_attention_layernorm.weight": norm(HIDDEN),
        })
    return out


def write_released(directory: Path, config: dict, seed: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(released_weights(seed), str(directory / "model.safetensors"))
    return directory


# ---- the oracle: the reference's forward, by hand -----------------------------------------------------------


def reference_causal(config: dict, layer: int) -> bool:
    """dflash 0.1.0: ``is_causal`` (top level) for every layer; absent, sliding layers only."""
    sliding = config["layer_types"][layer] == "sliding_attention"
    return sliding if config.get("is_causal") is None else bool(config["is_causal"])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, L, d] at positions pos [L] (NeoX halves)."""
    d = x.shape[-1]
    freqs = pos.double().unsqueeze(-1) / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [L, d/2]
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block_logits(config: dict, w: dict[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor,
                           features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The reference's logits [B, V] of a block at position P = len(features): context features [P, n*H] of
    positions 0..P-1, block tokens [B] at positions P..P+B-1 (the anchor first)."""
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    dc = config.get("dflash_config") or {}
    scale = float(dc.get("input_embedding_scale", config.get("input_embedding_scale", 1.0)))
    P, B = features.shape[0], block_ids.shape[0]
    ctx = _rms(features.float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [P, H]
    h = embed[block_ids] * scale  # [B, H]
    q_pos, k_pos = torch.arange(P, P + B), torch.arange(P + B)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([ctx, x])  # [P+B, H]
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(B, HEADS, HEAD_DIM), w[p + "self_attn.q_norm.weight"], eps)
        k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(P + B, KV_HEADS, HEAD_DIM),
                 w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(P + B, KV_HEADS, HEAD_DIM)
        q, k = _rope(q.transpose(0, 1), q_pos, theta), _rope(k.transpose(0, 1), k_pos, theta)  # [heads, L, d]
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        dist = q_pos.view(B, 1) - k_pos.view(1, P + B)  # query - key
        visible = torch.ones(B, P + B, dtype=torch.bool)
        causal = reference_causal(config, i)
        if causal:
            visible &= dist >= 0
        if config["layer_types"][i] == "sliding_attention":
            visible &= dist < config["sliding_window"]
            if not causal:
                visible &= -dist < config["sliding_window"]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)  # [heads, B, P+B]
        attn = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v  # [heads, B, d]
        h = h + attn.transpose(0, 1).reshape(B, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ w[p + "mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"], eps) @ lm_head.T  # [B, V]


# ---- the trainer's side -------------------------------------------------------------------------------------


def _spec(layers=(1, 2, 3), num_layers=6):
    return SimpleNamespace(teacher=SimpleNamespace(name_or_path="t", hidden_size=HIDDEN, vocab_size=VOCAB,
                                                   num_layers=num_layers),
                           target_layer_ids=list(layers), fingerprint="fp")


def _model_section(init_from: Path | None = None) -> ModelConfig:
    """The ``model`` section a user warm-starting from ``init_from`` writes: the released drafter's shapes."""
    layout = {}
    if init_from is not None:
        released = json.loads((Path(init_from) / "config.json").read_text())
        if set(released.get("layer_types") or []) <= {"full_attention", "sliding_attention"}:
            layout = {"layer_types": released.get("layer_types"), "sliding_window": released.get("sliding_window")}
        if released.get("architectures") == ["DFlash2DraftModel"]:
            layout.update(arch="dflash2", **{k: released["dflash_config"][k] for k in DFLASH2_MODULES})
    return ModelConfig(num_hidden_layers=LAYERS, block_size=BLOCK, mask_token_id=MASK, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=MLP, rope_theta=10000.0,
                       attention="sdpa", init_from=str(init_from) if init_from else None, **layout)


ANCHORS = [5, 9, 20, 33]


def _trained_logits(model, batch) -> torch.Tensor:
    blocks = build_blocks(FlatBatch.of(batch), torch.tensor(ANCHORS), BLOCK, MASK)
    with torch.no_grad():
        return model.logits(model(batch.features, blocks.block_ids, blocks.block_positions, blocks.layout))


def _oracle_logits(config, weights, head, batch) -> torch.Tensor:
    return torch.stack([reference_block_logits(config, weights, head[0], head[1], batch.features[0, :a],
                                               torch.cat([batch.input_ids[0, a:a + 1], torch.full((BLOCK - 1,), MASK)]))
                        for a in ANCHORS])


CASES = {
    "causality-absent": released_config(),
    "is_causal-true": released_config(is_causal=True),
    "is_causal-false": released_config(is_causal=False),
    "embedding-scale": released_config(dflash_config={"input_embedding_scale": 2.5}),
    "full-layers-is_causal-true": released_config(layer_types=["full_attention"] * 2, is_causal=True,
                                                  use_sliding_window=False, sliding_window=None),
    # both switches, disagreeing: is_causal decides, as in every engine that reads it (vLLM reads it before
    # dflash_config.causal; the reference and SGLang read only it)
    "is_causal-false-over-causal-true": released_config(is_causal=False, dflash_config={"causal": True}),
    "is_causal-true-over-causal-false": released_config(is_causal=True, dflash_config={"causal": False}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_released_config_trains_and_exports_as_the_reference_reads_it(tmp_path, name):
    config = CASES[name]
    released = write_released(tmp_path / "released", config)
    head = tiny_head(3)
    model = build_drafter(_model_section(released), _spec(), head)
    batch = tiny_batch(rows=1, length=48, seed=4)
    torch.testing.assert_close(_trained_logits(model, batch), _oracle_logits(config, released_weights(1), head, batch),
                               rtol=1e-4, atol=1e-4)
    # one training step moves the weights
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    dflash_loss(model, batch, num_anchors=8).loss.backward()
    opt.step()
    model.eval()
    after = _trained_logits(model, batch)
    out = export_drafter(model.state_dict(), model.config, tmp_path / "export", dtype="float32")
    exported = json.loads((out / "config.json").read_text())
    # the rule goes back out unchanged: the same causality key, the same per-layer reading, the same scale; the
    # vLLM key, when written, agrees with it (so that vLLM versions that read only dflash_config.causal agree too)
    assert exported.get("is_causal") == config.get("is_causal")
    assert exported["dflash_config"].get("causal", exported.get("is_causal")) == exported.get("is_causal")
    assert [reference_causal(exported, i) for i in range(LAYERS)] == [reference_causal(config, i) for i in range(LAYERS)]
    assert exported["dflash_config"].get("input_embedding_scale", 1.0) == config["dflash_config"].get(
        "input_embedding_scale", 1.0)
    weights = load_file(str(out / "model.safetensors"))
    assert not torch.equal(weights["fc.weight"], released_weights(1)["fc.weight"])  # it trained
    torch.testing.assert_close(_oracle_logits(exported, weights, head, batch), after, rtol=1e-4, atol=1e-4)
    # the shipped dflash.py reads the export as the reference does (its embedding scale included)
    draft = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    embedding = torch.nn.Embedding.from_pretrained(head[0])
    for n, a in enumerate(ANCHORS):
        block = torch.cat([batch.input_ids[0, a:a + 1], torch.full((BLOCK - 1,), MASK)]).unsqueeze(0)
        with torch.no_grad():
            h = draft(position_ids=torch.arange(a + BLOCK).unsqueeze(0), noise_embedding=draft.embed_block(embedding, block),
                      target_hidden=batch.features[:, :a].float())
        torch.testing.assert_close(h[0] @ head[1].T, after[n], rtol=1e-4, atol=1e-4)


def test_the_rules_really_differ_on_this_config():
    """Each case's oracle differs from the bidirectional, unscaled reading, so the equalities above tell them apart."""
    head, batch = tiny_head(3), tiny_batch(rows=1, length=48, seed=4)
    plain = _oracle_logits(CASES["is_causal-false"], released_weights(1), head, batch)
    for name in ("causality-absent", "is_causal-true", "embedding-scale"):
        assert (_oracle_logits(CASES[name], released_weights(1), head, batch) - plain).abs().max() > 1e-2, name


@pytest.mark.parametrize("config,names", [
    (released_config(attention_sink_bias=True), ["attention_sink_bias"]),
    (released_config(dflash_config={"attention_value_scale": 0.5}), ["dflash_config.attention_value_scale"]),
    (released_config(swa_window_size=128), ["swa_window_size"]),
    (released_config(dflash_config={"new_switch": 1}), ["dflash_config.new_switch"]),
    (released_config(layer_types=["linear_attention", "full_attention"]), ["linear_attention"]),
    (released_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["rope_scaling", "yarn"]),
    (released_config(dflash_config={"input_embedding_scale": 0.0}), ["input_embedding_scale"]),
    # the engines would read these differently: the rule the drafter was trained with is unknown
    (released_config(dflash_config={"causal": True}), ["dflash_config.causal", "is_causal", "vLLM"]),
    (released_config(dflash_config={"sliding_within_block": "bidirectional"}), ["sliding_within_block", "is_causal"]),
    (released_config(is_causal="yes"), ["is_causal"]),
], ids=["sink-bias", "value-scale", "swa-window", "unknown-dflash-key", "layer-type", "rope", "zero-scale",
        "causal-without-is_causal", "our-key-disagrees", "is_causal-not-bool"])
def test_a_released_config_asking_for_what_is_not_implemented_is_refused_by_name(tmp_path, config, names):
    released = write_released(tmp_path / "released", config)
    with pytest.raises(ConfigError) as err:
        build_drafter(_model_section(released), _spec(), tiny_head(3))
    assert all(n in str(err.value) for n in names), str(err.value)


@pytest.mark.parametrize("is_causal", [False, True])
def test_is_causal_decides_over_a_disagreeing_dflash_config_causal_with_a_warning(tmp_path, caplog, is_causal):
    """Both switches given, disagreeing: each layer follows is_causal (the engines' precedence), and the warm start
    says so, naming both keys and the vLLM versions that would read the other."""
    config = released_config(is_causal=is_causal, dflash_config={"causal": not is_causal})
    with caplog.at_level(logging.WARNING):
        model = build_drafter(_model_section(write_released(tmp_path / "r", config)), _spec(), tiny_head(3))
    rule = "causal" if is_causal else "bidirectional"
    assert [model.config.within_block(i) for i in range(LAYERS)] == [rule, rule]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is_causal" in r.getMessage()]
    assert len(said) == 1 and "is_causal decides" in said[0] and f"dflash_config.causal = {str(not is_causal).lower()}" \
        in said[0] and "vLLM versions" in said[0], said


def test_neutral_engine_fields_and_an_agreeing_causal_key_are_accepted(tmp_path):
    config = released_config(attention_sink_bias=False, attention_value_scale=1.0, swa_window_size=None,
                             is_neox_style=True, logit_scale=1.0, add_swa_attention_sink_bias=False, is_causal=False,
                             dflash_config={"causal": False, "sliding_within_block": "bidirectional",
                                            "swa_window_size": WINDOW})  # vLLM's window key, the same window
    model = build_drafter(_model_section(write_released(tmp_path / "r", config)), _spec(), tiny_head(3))
    assert [model.config.within_block(i) for i in range(LAYERS)] == ["bidirectional", "bidirectional"]


def test_reading_the_teachers_last_layer_warns_at_config_time_and_at_export(tmp_path, caplog):
    model = build_drafter(_model_section(), _spec(layers=(1, 3, 5)), tiny_head(3))
    assert any("SGLang" in r.getMessage() and "[5]" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
    caplog.clear()
    export_drafter(model.state_dict(), model.config, tmp_path / "e", dtype="float32")
    assert any("SGLang" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    caplog.clear()
    build_drafter(_model_section(), _spec(layers=(1, 3, 4)), tiny_head(3))  # layer 4 of 6: SGLang captures it
    assert not any("SGLang" in r.getMessage() for r in caplog.records)


# ---- DFlash2: the same reading, checked by which block rows an edit reaches ------------------------------------

DFLASH2_MODULES = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 8, "selector_rank": 4}


def released_dflash2(directory: Path, layer_types: list[str], **top) -> dict:
    """A released-style DFlash2 directory: ``DFlash2DraftModel`` with its modules in ``dflash_config`` and only the
    reference's causality key (``is_causal`` from ``top``, or none). Its weights are a randomised DFlash2 drafter
    of these shapes under the released tensor names; the oracle below does not read them."""
    sliding = "sliding_attention" in layer_types
    fresh = build_drafter(ModelConfig(num_hidden_layers=len(layer_types), block_size=BLOCK, mask_token_id=MASK,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      intermediate_size=MLP, rope_theta=10000.0, attention="sdpa", arch="dflash2",
                                      layer_types=layer_types, sliding_window=WINDOW if sliding else None,
                                      **DFLASH2_MODULES), _spec(), tiny_head(3))
    torch.manual_seed(11)
    with torch.no_grad():  # weights well away from the initialisation, so every path carries signal
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    export_drafter(fresh.state_dict(), fresh.config, directory, dtype="float32")
    config = json.loads((directory / "config.json").read_text())
    for key in ("is_causal",):
        config.pop(key, None)
    for key in ("causal", "sliding_within_block"):  # this product's keys: a released config has neither
        config["dflash_config"].pop(key, None)
    config.update(top)
    (directory / "config.json").write_text(json.dumps(config))
    return config


def _rows_reached_by_a_later_edit(model, batch, position: int) -> list[bool]:
    """Replace the block token at ``position`` (a mask, in every block) and report, per earlier block row, whether
    its logits changed: the attention pattern the model actually runs, whatever its mask code says."""
    blocks = build_blocks(FlatBatch.of(batch), torch.tensor(ANCHORS), BLOCK, MASK)
    edited = blocks.block_ids.clone()
    edited[:, position] = 7
    with torch.no_grad():
        base = model.logits(model(batch.features, blocks.block_ids, blocks.block_positions, blocks.layout))
        moved = model.logits(model(batch.features, edited, blocks.block_positions, blocks.layout))
    base, moved = base.view(len(ANCHORS), BLOCK, -1), moved.view(len(ANCHORS), BLOCK, -1)
    diff = (base - moved).abs().amax(dim=(0, 2))  # [BLOCK]
    assert diff[position] > 1e-3  # the edit reaches its own row
    for d in diff[:position]:
        assert d < 1e-6 or d > 1e-3, f"ambiguous change {d}"
    return [bool(d > 1e-3) for d in diff[:position]]


DFLASH2_LAYOUTS = {"sliding": ["sliding_attention"] * 2, "mixed": ["sliding_attention", "full_attention"],
                   "full": ["full_attention"] * 2}


@pytest.mark.parametrize("layout", list(DFLASH2_LAYOUTS))
@pytest.mark.parametrize("is_causal", [None, True, False], ids=["absent", "true", "false"])
def test_a_released_dflash2_config_attends_within_the_block_as_the_reference_reads_it(tmp_path, layout, is_causal):
    layer_types = DFLASH2_LAYOUTS[layout]
    config = released_dflash2(tmp_path / "released", layer_types,
                              **({} if is_causal is None else {"is_causal": is_causal}))
    model = build_drafter(_model_section(tmp_path / "released"), _spec(), tiny_head(3)).eval()
    assert model.config.arch == "dflash2"
    # the reference: earlier rows are shielded from a later block token only when every layer is causal (the
    # grouped convolution and the selector look backwards only); the window (6) reaches back from the last row
    every_layer_causal = all(reference_causal(config, i) for i in range(len(layer_types)))
    reached = _rows_reached_by_a_later_edit(model, tiny_batch(rows=1, length=48, seed=4), position=BLOCK - 1)
    assert not any(reached) if every_layer_causal else any(reached), reached
    # and the export says the same rule again
    out = export_drafter(model.state_dict(), model.config, tmp_path / "export", dtype="float32")
    exported = json.loads((out / "config.json").read_text())
    assert [reference_causal(exported, i) for i in range(len(layer_types))] == [
        reference_causal(config, i) for i in range(len(layer_types))]
    assert exported["architectures"] == ["DFlash2DraftModel"]


@pytest.mark.parametrize("arch,engines", [("dflash", "not applied by SGLang and vLLM"),
                                          ("dflash2", "not applied by SGLang (")])
def test_an_input_scale_an_engine_ignores_warns_at_config_time_and_at_export(tmp_path, caplog, arch, engines):
    """SGLang's DFlash config parser never reads the scale; vLLM applies it for DFlash2 only (docs/serving.md)."""
    if arch == "dflash":
        write_released(tmp_path / "r", released_config(dflash_config={"input_embedding_scale": 2.0}))
    else:
        released_dflash2(tmp_path / "r", DFLASH2_LAYOUTS["mixed"])
        config = json.loads((tmp_path / "r" / "config.json").read_text())
        config["dflash_config"]["input_embedding_scale"] = 2.0
        (tmp_path / "r" / "config.json").write_text(json.dumps(config))
    caplog.clear()
    model = build_drafter(_model_section(tmp_path / "r"), _spec(), tiny_head(3))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "input_embedding_scale" in
              r.getMessage()]
    assert len(warned) == 1 and engines in warned[0], warned
    caplog.clear()
    export_drafter(model.state_dict(), model.config, tmp_path / "e", dtype="float32")
    assert any(engines in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    caplog.clear()
    build_drafter(_model_section(write_released(tmp_path / "plain", released_config())), _spec(), tiny_head(3))
    assert not any("input_embedding_scale" in r.getMessage() for r in caplog.records)

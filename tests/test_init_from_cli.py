"""``dflash-train`` warm-started from a released drafter directory (``model.init_from``), through the real command.

The released directory is written here the way z-lab publishes its drafters (``config.json`` in the Qwen3 layout
with ``dflash_config``, ``model.safetensors`` under the released tensor names, no key of this product), shaped
for the small synthetic cache. Each causality reading (``is_causal`` absent / true / false, one with an input
embedding scale) trains a few steps, resumes, and exports; the export's ``config.json`` must say what the released
one said, read the same way, and its weights must be the released ones moved by training. A released config asking
for an engine field this trainer does not implement, or whose shapes differ from the ``model`` section, must stop
the command with exit code 2 and a one-line error that names the field, the file and what to set.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from fixtures.trainer import ROOT, run_train, small_cache, train_env
from safetensors.torch import load_file, save_file

from train.components.metrics import read_metrics

HIDDEN, TEACHER_LAYERS, CAPTURED, VOCAB, MASK = 64, 8, (1, 3, 5), 512, 511  # the synthetic cache (fixtures.trainer)
LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, BLOCK, WINDOW = 2, 4, 2, 32, 256, 8, 16  # configs/tiny.toml's drafter

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16", "train.optimizer=adamw"]
# the released drafter's layer layout, which the model section must state (the preset's layers are all full)
LAYOUT = ['model.layer_types=["sliding_attention","full_attention"]', f"model.sliding_window={WINDOW}"]
_run = partial(run_train, BASE, timeout=600)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return small_cache(str(tmp_path_factory.mktemp("cache") / "cache"))


def released_config(dflash_config: dict | None = None, **top) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(CAPTURED), **(dflash_config or {})},
        "dtype": "bfloat16", "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": MLP, "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 40960, "max_window_layers": LAYERS, "model_type": "qwen3",
        "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS,
        "num_target_layers": TEACHER_LAYERS, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": WINDOW, "tie_word_embeddings": False, "transformers_version": "4.57.1", "use_cache": True,
        "use_sliding_window": True, "vocab_size": VOCAB,
    }
    cfg.update(top)
    return cfg


def released_weights(seed: int = 3) -> dict[str, torch.Tensor]:
    """Random weights under the released tensor names and shapes (written out here, not asked of the model)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    out = {"fc.weight": w(HIDDEN, len(CAPTURED) * HIDDEN), "hidden_norm.weight": 1 + w(HIDDEN),
           "norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + w(HEAD_DIM), p + "self_attn.k_norm.weight": 1 + w(HEAD_DIM),
            p + "mlp.gate_proj.weight": w(MLP, HIDDEN), p + "mlp.up_proj.weight": w(MLP, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, MLP), p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
        })
    return {k: v.to(torch.bfloat16) for k, v in out.items()}  # as published


def write_released(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(released_weights(), str(directory / "model.safetensors"))
    return directory


def reference_causal(config: dict, layer: int) -> bool:
    """The DFlash reference's reading (dflash 0.1.0): ``is_causal`` for every layer; absent, sliding layers only."""
    sliding = config["layer_types"][layer] == "sliding_attention"
    return sliding if config.get("is_causal") is None else bool(config["is_causal"])


def export(run: Path, out: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "train.cli", "export", str(run), "--out", str(out),
                           "--dtype", "float32"], cwd=ROOT, env=train_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


CASES = {
    "is_causal-absent": released_config(),
    "is_causal-true-scaled": released_config(dflash_config={"input_embedding_scale": 2.0}, is_causal=True),
    "is_causal-false": released_config(is_causal=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_warm_start_trains_resumes_and_exports_the_released_reading(cache, tmp_path, name):
    config = CASES[name]
    released = write_released(tmp_path / "released", config)
    run, warm = tmp_path / "run", f"model.init_from={released}"
    first = _run(cache, run, *LAYOUT, warm, "train.max_steps=4", "checkpoint.every_steps=2")
    # resumes from step 4 (the warm start is not reapplied over the checkpoint)
    _run(cache, run, *LAYOUT, warm, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.allow_config_change=true")
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))
    done = export(run, tmp_path / "export")
    scale = config["dflash_config"].get("input_embedding_scale", 1.0)
    # SGLang and vLLM's DFlash model do not apply the scale: said when the drafter is built and at export
    for proc in (first, done):
        assert ("input_embedding_scale" in proc.stderr) == (scale != 1.0), proc.stderr[-2000:]

    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported.get("is_causal") == config.get("is_causal")
    assert exported["dflash_config"].get("causal", exported.get("is_causal")) == exported.get("is_causal")
    assert [reference_causal(exported, i) for i in range(LAYERS)] == [reference_causal(config, i) for i in range(LAYERS)]
    assert exported["dflash_config"].get("input_embedding_scale", 1.0) == scale
    assert exported["layer_types"] == config["layer_types"] and exported["sliding_window"] == WINDOW
    # the weights are the released ones, moved by six steps (a fresh initialisation would be uncorrelated)
    start, end = released_weights()["fc.weight"].float(), load_file(str(tmp_path / "export" / "model.safetensors"))[
        "fc.weight"].float()
    assert not torch.equal(start, end)
    assert torch.nn.functional.cosine_similarity(start.flatten(), end.flatten(), dim=0) > 0.9


def _refused(cache: str, tmp_path: Path, config: dict, *overrides: str) -> str:
    released = write_released(tmp_path / "released", config)
    proc = _run(cache, tmp_path / "run", *LAYOUT, f"model.init_from={released}", "train.max_steps=2", *overrides,
                expect=2)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], proc.stderr[-3000:]
    assert str(released) in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("config,names", [
    (released_config(dflash_config={"attention_sink_bias": True}), ["dflash_config.attention_sink_bias = true"]),
    (released_config(add_swa_attention_sink_bias=True), ["add_swa_attention_sink_bias = true"]),
    (released_config(dflash_config={"attention_value_scale": 0.707}), ["dflash_config.attention_value_scale"]),
    (released_config(dflash_config={"swa_window_size": 32}), ["dflash_config.swa_window_size = 32"]),
    (released_config(is_neox_style=False), ["is_neox_style = false"]),
], ids=["sink-bias", "vllm-sink-bias-key", "value-scale", "swa-window", "interleaved-rope"])
def test_a_released_engine_field_not_implemented_stops_the_cli_naming_it(cache, tmp_path, config, names):
    error = _refused(cache, tmp_path, config)
    assert "config.json" in error and all(n in error for n in names), error


@pytest.mark.parametrize("config,field,to_set", [
    (released_config(num_hidden_layers=1, layer_types=["sliding_attention"], max_window_layers=1),
     "model.num_hidden_layers", "--set model.num_hidden_layers=1"),
    (released_config(block_size=16), "model.block_size", "--set model.block_size=16"),
    (released_config(dflash_config={"mask_token_id": 510}), "model.mask_token_id", "--set model.mask_token_id=510"),
    (released_config(sliding_window=32), "model.sliding_window", "--set model.sliding_window=32"),
    (released_config(hidden_size=32), "hidden_size", "re-extract"),
    (released_config(dflash_config={"target_layer_ids": [1, 3, 6]}), "target_layer_ids", "cache.target_layer_ids"),
], ids=["layers", "block-size", "mask-token", "window", "hidden-size", "target-layers"])
def test_released_shapes_that_differ_from_the_run_stop_the_cli_saying_what_to_set(cache, tmp_path, config, field,
                                                                                  to_set):
    error = _refused(cache, tmp_path, config)
    assert field in error and to_set in error, error


def test_a_released_mask_embedding_file_is_refused_by_name(cache, tmp_path):
    released = write_released(tmp_path / "pre" / "released", released_config())
    torch.save(torch.zeros(HIDDEN), released / "mask_embedding.pt")
    proc = _run(cache, tmp_path / "run", *LAYOUT, f"model.init_from={released}", "train.max_steps=2", expect=2)
    assert "Traceback" not in proc.stderr and f"{released}/mask_embedding.pt" in proc.stderr.splitlines()[-1]


def test_a_released_config_that_is_not_one_is_refused_by_file_and_field(cache, tmp_path):
    config = released_config()
    del config["num_attention_heads"]
    assert "num_attention_heads" in _refused(cache, tmp_path, config)

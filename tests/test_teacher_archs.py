"""The presets' teacher families through the real commands, on tiny random-init teachers built locally:
extract -> ``dflash-cache info`` -> train -> teacher-forced eval + live lossless decoding (``eval --live``).

``qwen3_5`` is the Qwen3.5/3.6 hybrid (Gated DeltaNet + full attention, loaded from a
``Qwen3_5ForConditionalGeneration`` directory like the real 27B checkpoint), ``qwen3_moe`` a
mixture of experts, ``llama`` Llama; ``qwen3`` (the default tiny teacher) runs in the other tests.
The cache stores layers 1, 3 and 5 of 6, so the last layer (HF's normed ``hidden_states[6]``) is checked
against ``output_hidden_states`` too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dflash_cache.cli import main as cache_main
from dflash_cache.store import open_cache
from extract.cli import main as extract_main
from extract.tiny import TINY_MASK_TOKEN_ID, resolve_tiny_teacher
from train.cli import main as train_main
from train.components.metrics import read_metrics
from train.tools.evaluate import holdout_sample_ids

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [1, 3, 5]
HOLDOUT = 0.3
SETS = [
    "data.path=builtin:tiny-chat?n=20", f"cache.target_layer_ids={LAYERS}", "extract.unit_size=32",
    "train.max_steps=3", "train.num_anchors=8", "loader.tokens_per_batch=1024", f"loader.holdout_fraction={HOLDOUT}",
    "checkpoint.every_steps=3", "eval.live_prompts=2", "eval.live_max_new_tokens=12", "metrics.progress_bar=false",
    "metrics.tensorboard=false",
]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _sets(arch: str) -> list[str]:
    return [a for s in [f"teacher.path=builtin:tiny-{arch}", *SETS] for a in ("--set", s)]


def _bf16_close(cached: torch.Tensor, reference: torch.Tensor) -> bool:
    """``cached`` (bf16, computed in a padded batch) is ``reference`` (fp32, alone) up to bf16 rounding
    plus a little batch-shape noise. (Before the final norm the last layer has 2.3-3.2x the RMS: far off.)"""
    return bool(((cached.float() - reference).abs() <= reference.abs() * 2.0 ** -7 + 1e-3).all())


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_moe", "llama"])
def test_teacher_family_end_to_end(arch, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    cache_url, run = str(tmp_path / "cache"), tmp_path / "run"
    assert extract_main(["configs/tiny.toml", "--out", cache_url, "--no-progress", *_sets(arch)]) == 0
    capsys.readouterr()
    assert cache_main(["info", cache_url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["target_layer_ids"] == LAYERS and info["n_samples"] > 10
    assert (info["mask_token_id"], info["mask_token_source"]) == (TINY_MASK_TOKEN_ID, "tokenizer")

    # the cached features are HF's hidden_states[k + 1] for every stored k, the last layer included
    cache = open_cache(cache_url)
    assert cache.spec.teacher.name_or_path == f"builtin:tiny-{arch}" and cache.spec.teacher.num_layers == 6
    teacher = AutoModelForCausalLM.from_pretrained(resolve_tiny_teacher(arch=arch)).eval()
    sample = cache.read_sample(int(cache.index().sample_ids[0]))
    with torch.no_grad():
        hs = teacher(input_ids=sample.input_ids[None], output_hidden_states=True).hidden_states
    H = teacher.config.get_text_config().hidden_size
    for i, k in enumerate(LAYERS):
        assert _bf16_close(sample.features[:, i * H:(i + 1) * H], hs[k + 1][0]), f"layer {k}"

    assert train_main(["configs/tiny.toml", "--cache", cache_url, "--run-dir", str(run), *_sets(arch)]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    capsys.readouterr()
    assert train_main(["eval", "configs/tiny.toml", "--cache", cache_url, "--checkpoint", str(run), "--live",
                       "--json", *_sets(arch)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n_blocks"] > 0 and 1.0 <= report["acceptance_length"] <= 8.0
    live = report["live"]
    assert live["lossless"] is True and live["prompt_source"] == "holdout"
    held = set(holdout_sample_ids(cache, HOLDOUT).tolist())
    assert len(live["prompts"]) == 2 and {p["sample_id"] for p in live["prompts"]} <= held
    for p in live["prompts"]:
        assert 1.0 <= p["tau"] <= 8.0 and p["cycles"] == len(p["accepted_per_cycle"]) >= 1
    assert live["tau"] == pytest.approx(sum(p["tau"] for p in live["prompts"]) / 2)


def test_hybrid_teacher_kernel_hint(monkeypatch, caplog):
    """Missing Gated DeltaNet kernels: a warning with the pip command on CUDA, nothing above debug on CPU;
    ``dflash-extract estimate`` names them either way."""
    import logging

    from extract import teacher as teacher_mod
    from extract.cli_args import load_run_config
    from extract.estimate import estimate

    monkeypatch.setattr(teacher_mod.importlib.util, "find_spec", lambda name: None)
    cfg = load_run_config("configs/tiny.toml", ["teacher.path=builtin:tiny-qwen3_5", "data.path=builtin:tiny-chat?n=4"],
                          None, False)
    text = teacher_mod.load_teacher_config(cfg.teacher)
    assert teacher_mod.missing_kernels(text) == {"linear_attention": ["flash-linear-attention", "causal-conv1d"]}
    with caplog.at_level(logging.DEBUG, logger="extract.teacher"):
        teacher_mod.warn_missing_kernels(text, torch.device("cpu"))
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        caplog.clear()
        monkeypatch.setenv("RANK", "0")
        teacher_mod.warn_missing_kernels(text, torch.device("cuda", 0))
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert "pip install causal-conv1d flash-linear-attention" in caplog.records[0].getMessage()
    assert "pip install causal-conv1d flash-linear-attention" in "\n".join(estimate(cfg).lines("bf16-zstd"))
    llama = load_run_config("configs/tiny.toml", ["teacher.path=builtin:tiny-llama"], None, False)
    assert teacher_mod.missing_kernels(teacher_mod.load_teacher_config(llama.teacher)) == {}


def test_unknown_builtin_teacher_is_a_clear_error(tmp_path, capsys):
    rc = extract_main(["configs/tiny.toml", "--out", str(tmp_path / "c"), "--set", "teacher.path=builtin:tiny-gpt2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "builtin:tiny-gpt2" in err and "builtin:tiny-qwen3_5" in err
    assert not os.path.exists(tmp_path / "c")

"""The embedded tiny teacher: a real, loadable HF Qwen3 directory with a chat template and varied generations."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from extract.builtin_text import builtin_conversations
from extract.tiny import TINY_MASK_TOKEN_ID, build_tiny_teacher, resolve_tiny_teacher

FAMILIES = {  # arch -> (model_type and class on disk, class AutoModelForCausalLM loads)
    "qwen3_5": ("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM", "LlamaForCausalLM"),
}


def test_tiny_teacher_is_a_real_qwen3_directory(tiny_teacher_dir):
    cfg = json.loads((tiny_teacher_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    assert (tiny_teacher_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir)
    tok = AutoTokenizer.from_pretrained(tiny_teacher_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 128
    assert tok.convert_ids_to_tokens(TINY_MASK_TOKEN_ID) == "<|mask|>"
    assert tok.mask_token_id == TINY_MASK_TOKEN_ID  # what dflash-extract records as the mask token
    assert len(tok) <= model.config.vocab_size
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_build_is_deterministic(tiny_teacher_dir, tmp_path):
    other = build_tiny_teacher(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (tiny_teacher_dir / name).read_bytes(), name


def test_builtin_resolves_and_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    first = resolve_tiny_teacher()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_tiny_teacher() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == tmp_path


def test_greedy_generations_are_varied_and_deterministic(tiny_teacher_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_teacher_dir, padding_side="left")
    prompts = [
        tok.apply_chat_template(c["messages"][:-1] if c["messages"][-1]["role"] == "assistant" else c["messages"],
                                tokenize=False, add_generation_prompt=True)
        for c in builtin_conversations(12)
    ]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        a = model.generate(**enc, max_new_tokens=40, do_sample=False)[:, enc["input_ids"].shape[1]:]
        b = model.generate(**enc, max_new_tokens=40, do_sample=False)[:, enc["input_ids"].shape[1]:]
    assert torch.equal(a, b)
    per_seq_distinct = [len(set(row.tolist())) for row in a]
    assert min(per_seq_distinct) >= 15  # no collapse onto a few repeated tokens
    assert len({tuple(row.tolist()) for row in a}) == len(a)  # different prompts, different continuations
    assert (a[:, 1:] == a[:, :-1]).float().mean() < 0.05
    # generations decode to text that re-tokenizes to the same ids (regenerate -> extract round trip)
    for row in a:
        assert tok(tok.decode(row), add_special_tokens=False)["input_ids"] == row.tolist()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_tiny_teacher_families_are_real_hf_directories(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    path = resolve_tiny_teacher(arch=arch)
    assert path == tmp_path / f"tiny-teacher-v2-{arch}"
    model_type, on_disk, loaded = FAMILIES[arch]
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == (model_type, [on_disk])
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    text = model.config.get_text_config()
    assert type(model).__name__ == loaded and text.num_hidden_layers == 6 and text.hidden_size == 128
    assert tok.mask_token_id == TINY_MASK_TOKEN_ID and model.generation_config.eos_token_id == tok.eos_token_id
    if arch == "qwen3_5":  # the Qwen3.5/3.6 layout: three Gated DeltaNet layers, then full attention
        assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    if arch == "qwen3_moe":
        assert text.num_experts == 4 and text.num_experts_per_tok == 2
    other = build_tiny_teacher(tmp_path / "again", arch=arch)
    assert (other / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()

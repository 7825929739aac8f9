"""The teacher's final normed hidden state in the cache: capture, extraction, fingerprint, info, estimate."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_cache import open_cache, verify_cache
from dflash_cache.cli import main as cache_main
from dflash_cache.spec import CacheSpec, TeacherInfo
from dflash_cache.synthetic import make_synthetic_cache
from extract.cli import main as extract_main
from extract.teacher import capture_features, capture_features_and_argmax, capture_features_and_final

ROOT = Path(__file__).resolve().parents[1]


def _spec(**kw) -> CacheSpec:
    return CacheSpec(teacher=TeacherInfo("t", None, 8, 64, 512), target_layer_ids=(1, 3, 5), tokenizer_hash="x",
                     max_length=256, **kw)


def test_spec_slot_and_fingerprint():
    plain, final = _spec(), _spec(final_hidden=True)
    assert plain.feature_dim == 3 * 64 and final.feature_dim == 4 * 64 and final.layer_feature_dim == 3 * 64
    assert "final_hidden" not in plain.to_dict()  # caches written before it keep their fingerprint
    assert plain.fingerprint != final.fingerprint and plain.diff(final) == ["final_hidden"]
    assert CacheSpec.from_dict(final.to_dict()) == final


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_capture_final_equals_last_hidden_state(arch):
    from extract.tiny import resolve_tiny_teacher

    model = AutoModelForCausalLM.from_pretrained(resolve_tiny_teacher(arch=arch)).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 700, (2, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    h = model.config.get_text_config().hidden_size
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    feats, argmax = capture_features_and_final(model, ids, mask, [1, 2], with_argmax=True)
    assert feats.shape == (2, 17, 3 * h)
    assert torch.equal(feats[..., :2 * h], capture_features(model, ids, mask, [1, 2])[0])
    assert torch.equal(feats[..., 2 * h:], hs[-1])  # what output_hidden_states returns last
    assert torch.equal(argmax, capture_features_and_argmax(model, ids, mask, [1, 2])[1])
    assert capture_features_and_final(model, ids, mask, [1, 2])[1] is None


@pytest.mark.parametrize("codec", ["bf16-zstd", "fp8-e4m3"])
def test_extract_stores_the_final_state(tiny_teacher_dir, tmp_path, capsys, codec):
    out = tmp_path / "cache"
    args = ["configs/tiny.toml", "--out", str(out), "--no-progress", "--set", f"teacher.path={tiny_teacher_dir}",
            "--set", "data.path=builtin:tiny-chat?n=6", "--set", "extract.unit_size=8",
            "--set", "cache.store_final_hidden=true", "--set", f"cache.codec={codec}"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert extract_main(args) == 0
    finally:
        os.chdir(cwd)
    cache = open_cache(str(out))
    assert cache.spec.final_hidden and cache.spec.feature_slots == 4
    assert verify_cache(str(out)) is not None
    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    s = cache.read_sample(3)
    with torch.no_grad():
        hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[k + 1][0] for k in (1, 2, 3)] + [hs[-1][0]], -1)
    tol = dict(atol=0.05, rtol=0.02) if codec.startswith("bf16") else dict(atol=0.2, rtol=0.1)
    torch.testing.assert_close(s.features.float(), want.float(), **tol)
    capsys.readouterr()
    assert cache_main(["info", str(out)]) == 0
    assert "final state  stored" in capsys.readouterr().out
    if codec == "bf16-zstd":  # resuming into it without the final state is refused, naming the field
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            without = args[:args.index("cache.store_final_hidden=true") - 1] + args[-2:]  # same codec, no final state
            assert extract_main(without) == 2
        finally:
            os.chdir(cwd)
        assert "final_hidden" in capsys.readouterr().err
    assert cache_main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["final_hidden"] is True


def test_info_says_when_the_final_state_is_missing(tmp_path, capsys):
    make_synthetic_cache(str(tmp_path / "c"), n_samples=4)
    assert cache_main(["info", str(tmp_path / "c")]) == 0
    assert "cache.store_final_hidden = true" in capsys.readouterr().out


def test_extract_estimate_counts_the_final_state(tiny_teacher_dir, capsys):
    from extract.estimate import cli_main

    base = ["configs/tiny.toml", "--set", f"teacher.path={tiny_teacher_dir}", "--set", "data.path=builtin:tiny-chat?n=6"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert cli_main(base) == 0
        plain = capsys.readouterr().out
        assert cli_main([*base, "--set", "cache.store_final_hidden=true"]) == 0
        final = capsys.readouterr().out
    finally:
        os.chdir(cwd)

    def raw_size(text: str) -> str:
        return next(line for line in text.splitlines() if line.strip().startswith("bf16-raw"))

    assert "final normed state (128) = 512" in final and "final normed state" not in plain
    assert raw_size(plain) != raw_size(final)

"""Export: released layout (names, shapes, config), round trip, run dirs, released dirs, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fixtures.drafters import HIDDEN, VOCAB, tiny_batch, tiny_drafter, tiny_head
from safetensors import safe_open

from dflash_cache.errors import ConfigError, SpecMismatchError
from dflash_cache.runtime.config import config_to_dict
from dflash_cache.runtime.schema import PipelineConfig
from train.components.checkpoint import Checkpointer
from train.config import CheckpointConfig, ModelConfig
from train.models.factory import build_drafter, load_drafter_dir
from train.models.model import DFlashConfig
from train.models.objective import dflash_loss
from train.tools.export import cli_main, config_for, expected_shapes, load_weights, resolve_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_8b_dflash_b16.json"


def _spec(hidden=HIDDEN, vocab=VOCAB, layers=(1, 2, 3)):
    return SimpleNamespace(teacher=SimpleNamespace(name_or_path="test-teacher", hidden_size=hidden,
                                                   vocab_size=vocab, num_layers=6),
                           target_layer_ids=list(layers), fingerprint="fp-test")


def _model_section(**kw) -> ModelConfig:
    base = dict(num_hidden_layers=2, block_size=8, mask_token_id=VOCAB - 1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, attention="sdpa")
    base.update(kw)
    return ModelConfig(**base)


def _save_run(run_dir: Path, model, steps=(5, 10)) -> None:
    cfg = PipelineConfig(model=_model_section())
    ck = Checkpointer(run_dir, CheckpointConfig(keep_last=3), config=config_to_dict(cfg), cache_fingerprint="fp-test")
    for step in steps:
        with torch.no_grad():
            model.fc.weight.add_(0.01)
        ck.save(step, model.state_dict(), {"step": step})
        ck.wait()
    ck.close()


def test_names_shapes_and_config_match_the_released_qwen3_8b_drafter():
    fixture = json.loads(FIXTURE.read_text())
    released = fixture["config"]
    cfg = DFlashConfig.from_hf_dict(released)
    assert {k: list(v) for k, v in expected_shapes(cfg).items()} == fixture["weights"]
    ours = cfg.to_hf_dict()
    assert ours == released  # every field, including dflash_config and block_size
    # built the way training builds it: model section of the 8B preset + a cache spec of Qwen3-8B
    spec = _spec(hidden=4096, vocab=151936, layers=(1, 9, 17, 25, 33))
    spec.teacher.num_layers = 36
    spec.mask_token_id = 151669  # recorded by dflash-extract (the 8B preset sets model.mask_token_id)
    from train.models.model import drafter_config

    mc = ModelConfig(mask_token_id=None, max_position_embeddings=40960)
    built = drafter_config(mc, spec)
    assert {k: list(v) for k, v in expected_shapes(built).items()} == fixture["weights"]
    assert built.mask_token_id == 151669
    for key in ("architectures", "block_size", "dflash_config", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                "num_target_layers", "rope_theta", "layer_types", "model_type"):
        assert built.to_hf_dict()[key] == released[key], key


def _export_run(run: Path, out: Path, dtype: str = "float32") -> Path:
    from train.tools.export import export_drafter

    loaded = load_weights(run)
    return export_drafter(loaded.state, config_for(loaded, _spec()), out, dtype=dtype)


def test_export_round_trip_gives_identical_logits(tmp_path):
    model = tiny_drafter(seed=7)
    _save_run(tmp_path / "run", model)
    assert resolve_checkpoint(tmp_path / "run").name == "step-00000010"
    out = _export_run(tmp_path / "run", tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2, 3]}
    assert cfg["block_size"] == 8
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(model.state_dict()) and not any("embed" in n or "lm_head" in n for n in names)
    reloaded = load_drafter_dir(out, tiny_head(7), attention="sdpa").eval()
    batch = tiny_batch(rows=2, length=40, seed=3)
    with torch.no_grad():
        a = dflash_loss(model, batch, num_anchors=8)
        b = dflash_loss(reloaded, batch, num_anchors=8)
    assert torch.equal(a.loss, b.loss)
    assert torch.equal(a.metrics["position_correct"], b.metrics["position_correct"])


def test_export_cli_writes_bf16_by_default(tmp_path):
    model = tiny_drafter(seed=7)
    _save_run(tmp_path / "run", model, steps=(3,))
    src = _export_run(tmp_path / "run", tmp_path / "fp32")
    assert cli_main([str(src), "--out", str(tmp_path / "e")]) == 0
    with safe_open(str(tmp_path / "e" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}
        w = f.get_tensor("fc.weight")
    assert json.loads((tmp_path / "e" / "config.json").read_text())["dtype"] == "bfloat16"
    torch.testing.assert_close(w.float(), model.fc.weight.detach(), rtol=1e-2, atol=1e-3)


def test_export_needs_the_cache_when_the_checkpoint_does_not_say(tmp_path):
    model = tiny_drafter(seed=7)
    _save_run(tmp_path / "run", model, steps=(3,))
    loaded = load_weights(tmp_path / "run")
    if loaded.config is None:  # the checkpoint's weights carry no drafter config metadata
        with pytest.raises(ConfigError, match="--cache"):
            config_for(loaded, None)
    assert config_for(loaded, _spec()).target_layer_ids == [1, 2, 3]


@pytest.mark.parametrize("spec,field", [(_spec(hidden=32), "hidden_size"), (_spec(layers=(1, 2)), "target_layer_ids")])
def test_checkpoint_that_disagrees_with_the_cache_names_the_field(tmp_path, spec, field):
    _save_run(tmp_path / "run", tiny_drafter(seed=7), steps=(3,))
    with pytest.raises(SpecMismatchError, match=field) as err:
        config_for(load_weights(tmp_path / "run"), spec)
    assert err.value.fields == [field]


def test_released_drafter_dir_disagreeing_with_the_cache_names_the_field(tmp_path):
    _save_run(tmp_path / "run", tiny_drafter(seed=7), steps=(3,))
    out = _export_run(tmp_path / "run", tmp_path / "rel")
    with pytest.raises(SpecMismatchError, match="vocab_size") as err:
        config_for(load_weights(out), _spec(vocab=200))
    assert err.value.fields == ["vocab_size"]


def test_continue_training_from_a_released_drafter_dir(tmp_path):
    model = tiny_drafter(seed=9)
    from train.tools.export import export_drafter

    export_drafter(model.state_dict(), model.config, tmp_path / "released", dtype="float32")
    mc = _model_section(init_from=str(tmp_path / "released"))
    resumed = build_drafter(mc, _spec(), tiny_head(9))
    for k, v in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    with pytest.raises(SpecMismatchError, match="vocab_size"):
        build_drafter(mc, _spec(vocab=200), tiny_head(9, vocab=200))
    with pytest.raises(SpecMismatchError, match="hidden_size"):
        build_drafter(mc, _spec(hidden=32), tiny_head(9, hidden=32))


def test_bad_drafter_configs_are_rejected():
    with pytest.raises(ConfigError, match="mask_token_id"):
        build_drafter(_model_section(mask_token_id=VOCAB), _spec(), tiny_head())
    with pytest.raises(ConfigError, match="block_size"):
        DFlashConfig.from_hf_dict({**json.loads(FIXTURE.read_text())["config"], "block_size": 1})
    with pytest.raises(ValueError, match="block_size"):
        _model_section(block_size=1)
    with pytest.raises(ConfigError, match="not supported"):
        DFlashConfig.from_hf_dict({**json.loads(FIXTURE.read_text())["config"], "architectures": ["Other"]})


def test_run_dir_without_a_committed_checkpoint_is_an_error(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-00000001.tmp").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        resolve_checkpoint(tmp_path / "run")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")


def test_export_refuses_to_overwrite(tmp_path):
    _save_run(tmp_path / "run", tiny_drafter(seed=7), steps=(3,))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep")
    src = _export_run(tmp_path / "run", tmp_path / "src")
    with pytest.raises(ConfigError, match="overwrite"):
        cli_main([str(src), "--out", str(tmp_path / "out")])
    cli_main([str(src), "--out", str(tmp_path / "out"), "--overwrite"])
    assert not (tmp_path / "out" / "x").exists()


def test_exported_files_share_one_mode_readable_by_other_users(tmp_path):
    # safetensors creates the weights 0600: a server running as another user could read config.json only
    model = tiny_drafter(seed=7)
    _save_run(tmp_path / "run", model, steps=(3,))
    old = os.umask(0o022)
    try:
        assert cli_main([str(_export_run(tmp_path / "run", tmp_path / "fp32")), "--out", str(tmp_path / "e")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "e").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes

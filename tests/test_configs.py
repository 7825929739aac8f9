"""Every shipped preset validates against the schema, and its layer ids fit the stated teacher."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_cache.errors import ConfigError
from dflash_cache.runtime.config import load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))

# Published shapes of the teachers the real presets name: (decoder layers, vocab size).
KNOWN_TEACHERS = {
    "Qwen/Qwen3-8B": (36, 151936),
    "Qwen/Qwen3.6-27B": (64, 248320),
}


def test_presets_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.toml", "qwen3-8b.toml", "qwen3.6-27b.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_preset_validates(path):
    cfg = load_config(path)
    assert cfg.model.block_size >= 2
    if cfg.model.layer_types is not None:
        assert len(cfg.model.layer_types) == cfg.model.num_hidden_layers


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name != "tiny.toml"], ids=lambda p: p.name)
def test_real_preset_layer_ids_fit_teacher(path):
    from extract.teacher import default_layer_ids

    cfg = load_config(path)
    num_layers, vocab = KNOWN_TEACHERS[cfg.teacher.path]
    ids = cfg.cache.target_layer_ids
    assert ids == default_layer_ids(num_layers, cfg.cache.num_target_layers)
    assert all(0 <= i < num_layers for i in ids)
    assert cfg.model.mask_token_id is not None and 0 <= cfg.model.mask_token_id < vocab


def test_unknown_key_and_bad_override_name_the_dotted_path(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = 1e-3\nlearning_rate = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad, ["model.block_size=1", "loader.tokens_per_batch=-5"])
    text = str(err.value)
    assert "train.learning_rate: unknown key" in text
    assert "model.block_size" in text
    assert "loader.tokens_per_batch" in text


def test_override_is_typed(tmp_path):
    cfg = load_config(CONFIGS[0], ["train.lr=1e-4", "cache.bucket_edges=[10, 20]", "teacher.path=some/dir"])
    assert cfg.train.lr == 1e-4
    assert cfg.cache.bucket_edges == [10, 20]
    assert cfg.teacher.path == "some/dir"


def test_recipe_options_are_validated():
    tiny = Path(__file__).parent.parent / "configs" / "tiny.toml"
    cfg = load_config(tiny, ["train.loss_weighting=dpace", "train.optimizer=muon", "train.muon_lr=1e-3"])
    assert (cfg.train.loss_weighting, cfg.train.optimizer, cfg.train.muon_lr) == ("dpace", "muon", 1e-3)
    with pytest.raises(ConfigError) as err:
        load_config(tiny, ["train.loss_weighting=dpace", "train.loss_gamma=5", "train.dpace_alpha=0",
                           "train.optimizer=sgd"])
    text = str(err.value)
    assert "train.dpace_alpha" in text and "train.optimizer" in text
    with pytest.raises(ConfigError, match="loss_gamma sets the exp_decay weights"):
        load_config(tiny, ["train.loss_weighting=dpace", "train.loss_gamma=5"])


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


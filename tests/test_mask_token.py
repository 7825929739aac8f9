"""The drafter's mask token is resolved once at extraction, recorded in the cache spec with its source,
and read from there by training; a config that disagrees is an error naming both values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_cache.cli import main as cache_main
from dflash_cache.errors import ConfigError, SpecMismatchError
from dflash_cache.spec import CacheSpec, TeacherInfo
from dflash_cache.store import open_cache
from extract.cli import main as extract_main
from extract.teacher import resolve_mask_token
from extract.tiny import TINY_MASK_TOKEN_ID
from train.cli import main as train_main
from train.config import ModelConfig
from train.models.model import resolve_mask_token_id
from train.tools.export import load_weights

ROOT = Path(__file__).resolve().parents[1]
SETS = ["data.path=builtin:tiny-chat?n=12", "train.max_steps=2", "train.num_anchors=8", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=1024", "checkpoint.every_steps=2", "metrics.progress_bar=false",
        "metrics.tensorboard=false", "eval.every_steps=1000"]


def _sets(teacher, *extra: str) -> list[str]:
    return [a for s in [f"teacher.path={teacher}", *SETS, *extra] for a in ("--set", s)]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_resolution_order_config_then_tokenizer_then_error():
    with_mask = SimpleNamespace(mask_token_id=5, mask_token="<|mask|>")
    without = SimpleNamespace(mask_token_id=None, mask_token=None)
    assert resolve_mask_token(7, with_mask, 100) == (7, "config")  # explicit wins
    assert resolve_mask_token(None, with_mask, 100) == (5, "tokenizer")
    with pytest.raises(ConfigError, match="model.mask_token_id is not set and the teacher's tokenizer has no mask"):
        resolve_mask_token(None, without, 100)
    with pytest.raises(ConfigError, match=r"model.mask_token_id = 100 is outside the teacher vocabulary \[0, 100\)"):
        resolve_mask_token(100, without, 100)


def test_extraction_records_it_and_training_reads_it(tiny_teacher_dir, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert extract_main(["configs/tiny.toml", "--out", cache, "--no-progress", *_sets(tiny_teacher_dir)]) == 0
    spec = open_cache(cache).spec
    assert (spec.mask_token_id, spec.mask_token_source) == (TINY_MASK_TOKEN_ID, "tokenizer")
    capsys.readouterr()
    assert cache_main(["info", cache]) == 0
    assert f"mask token   {TINY_MASK_TOKEN_ID} (from the tokenizer)" in capsys.readouterr().out

    run = tmp_path / "run"
    assert train_main(["configs/tiny.toml", "--cache", cache, "--run-dir", str(run), *_sets(tiny_teacher_dir)]) == 0
    assert load_weights(str(run)).config.mask_token_id == TINY_MASK_TOKEN_ID
    capsys.readouterr()
    other = TINY_MASK_TOKEN_ID + 1
    rc = train_main(["configs/tiny.toml", "--cache", cache, "--run-dir", str(tmp_path / "run2"),
                     *_sets(tiny_teacher_dir, f"model.mask_token_id={other}")])
    assert rc == 2
    err = capsys.readouterr().err
    assert (f"model.mask_token_id = {other}, but the cache was extracted with mask_token_id {TINY_MASK_TOKEN_ID} "
            "(from the tokenizer)") in err


def test_an_explicit_mask_token_is_recorded_as_config(tiny_teacher_dir, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    sets = _sets(tiny_teacher_dir, "model.mask_token_id=7")
    assert extract_main(["estimate", "configs/tiny.toml", *sets]) == 0
    assert "mask token: 7 (from the config)" in capsys.readouterr().out
    assert extract_main(["configs/tiny.toml", "--out", cache, "--no-progress", *sets]) == 0
    capsys.readouterr()
    assert cache_main(["info", cache, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["mask_token_id"], info["mask_token_source"]) == (7, "config")


def test_a_tokenizer_without_a_mask_token_needs_the_config(tiny_teacher_dir, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher_dir, teacher)
    tok_cfg = json.loads((teacher / "tokenizer_config.json").read_text())
    del tok_cfg["mask_token"]
    (teacher / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    rc = extract_main(["configs/tiny.toml", "--out", str(tmp_path / "c"), "--no-progress", *_sets(teacher)])
    assert rc == 2
    assert "Set model.mask_token_id to an id below 768" in capsys.readouterr().err


def test_caches_written_before_it_was_recorded_keep_their_fingerprint_and_need_the_config():
    old = CacheSpec(TeacherInfo("Qwen/Qwen3-8B", None, 36, 4096, 151936, "bfloat16"), [1, 9, 17, 25, 33], "abcd",
                    3072, dataset_fingerprint="data")
    assert "mask_token_id" not in old.to_dict()
    assert old.fingerprint == "b50ec61006b6df9c"  # what the previous release stored for this spec
    assert resolve_mask_token_id(ModelConfig(mask_token_id=151669), old) == 151669
    with pytest.raises(ConfigError, match="does not record a mask token"):
        resolve_mask_token_id(ModelConfig(), old)
    new = CacheSpec(**{**old.__dict__, "mask_token_id": 151669, "mask_token_source": "config"})
    assert new.fingerprint != old.fingerprint  # the mask token is part of compatibility ...
    relabelled = CacheSpec(**{**new.__dict__, "mask_token_source": "tokenizer"})
    assert relabelled.fingerprint == new.fingerprint  # ... where it came from is not
    with pytest.raises(SpecMismatchError, match="model.mask_token_id = 3, but the cache was extracted with "
                                                "mask_token_id 151669 \\(from the config\\)"):
        resolve_mask_token_id(ModelConfig(mask_token_id=3), new)
    with pytest.raises(ConfigError, match="outside the teacher vocabulary"):
        CacheSpec(**{**old.__dict__, "mask_token_id": 151936})

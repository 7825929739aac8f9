"""What ``info``, ``verify`` and ``dflash-train`` say about the extraction that wrote a cache, whatever else
is true of it (dflash_cache/extraction.py):

- damage is damage: a committed part damaged inside an unfinished extraction makes ``verify`` exit 2 (not 3,
  "unfinished"), naming the part;
- a cache written by ``dflash-extract`` before extraction plans were recorded (``meta/config.json``, no
  ``meta/extract_plan.json``) is unfinished, of a plan not recorded, until its report
  (``meta/extract_report.json``) is there: ``verify`` exits 3, ``info`` says so, ``dflash-train`` refuses it
  (unless ``loader.allow_unfinished``); with its report it is finished and trains.

The caches are made here: a small synthetic cache plus parts of two work units written as ``dflash-extract``
writes them (``meta.unit``, ``meta.unit_parts``), and the extraction's records as files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fixtures.trainer import ROOT, small_cache, train_argv

from dflash_cache import open_cache
from dflash_cache.cli import main as cache_main
from dflash_cache.synthetic import synthetic_features

UNITS_WRITTEN = 2  # units 0 and 1, one part each
PLAN_UNITS = 5
BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16", "metrics.tensorboard=false", "train.max_steps=1",
        "checkpoint.every_steps=100000", "model.num_hidden_layers=1"]


def _cache_with_units(url: Path) -> Path:
    small_cache(str(url), n_samples=12, samples_per_part=6)
    cache = open_cache(str(url))
    for u in range(UNITS_WRITTEN):
        g = torch.Generator().manual_seed(100 + u)
        with cache.part_writer(cache.bucket_of(70), f"u{u:07d}", meta={"unit": u, "unit_parts": 1}) as w:
            for i in range(3):
                w.add(10_000 + 10 * u + i, torch.randint(0, 500, (70,), generator=g),
                      torch.ones(70, dtype=torch.bool), synthetic_features(70, 3, 64, g))
    return url


def _records(url: Path, *, plan: bool, config: bool, report: bool) -> None:
    """The extraction's own records, as ``dflash-extract`` writes them (any of them)."""
    meta = url / "meta"
    meta.mkdir(exist_ok=True)
    if plan:
        (meta / "extract_plan.json").write_text(json.dumps({"n_units": PLAN_UNITS, "unit_size": 3, "n_records": 15}))
    if config:
        (meta / "config.json").write_text(json.dumps({"data": {"path": "chat.jsonl"}, "extract": {"unit_size": 3}}))
    if report:
        (meta / "extract_report.json").write_text(json.dumps({"samples_written": 18, "samples_in_cache": 18}))


def _damage_a_committed_unit_part(url: Path) -> str:
    part = next(p for p in open_cache(str(url)).parts() if p.name == "u0000001")
    shard = url / part.data_key / "features" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    return part.key


def _train(url: Path, run: Path, *overrides: str) -> int:
    from train.cli import main as train_main

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return train_main(train_argv(BASE, str(url), run, *overrides))
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CACHE_FSYNC", "0")
        return _cache_with_units(tmp_path_factory.mktemp("state") / "clean")


def _copy(clean: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(clean, tmp_path / "c")
    return tmp_path / "c"


@pytest.mark.parametrize("layout", ["plan", "old_layout"])
def test_damage_inside_an_unfinished_extraction_is_damage(clean, tmp_path, capsys, layout):
    """An unfinished extraction (a plan without a report, or the layout from before plans were recorded) whose
    committed part has a flipped byte: verify exits 2 and names the part; the summary still says unfinished."""
    url = _copy(clean, tmp_path)
    _records(url, plan=layout == "plan", config=True, report=False)
    assert cache_main(["verify", str(url)]) == 3  # unfinished and undamaged, before the damage
    capsys.readouterr()
    key = _damage_a_committed_unit_part(url)
    assert cache_main(["verify", str(url)]) == 2
    said = capsys.readouterr()
    assert "verify found 1 problem(s)" in said.err and f"part {key}, array features" in said.err
    assert "no damage found" not in said.err
    assert "extraction not finished" in said.out


def test_a_cache_from_before_extraction_plans_is_unfinished_until_its_report(clean, tmp_path, capsys):
    """meta/config.json without meta/extract_plan.json or a report: unfinished, of a plan not recorded (verify
    exit 3, info says so, dflash-train refuses it unless loader.allow_unfinished); once its report is there it
    is finished (verify exit 0) and trains."""
    url = _copy(clean, tmp_path)
    _records(url, plan=False, config=True, report=False)
    assert not (url / "meta/extract_plan.json").exists()
    said = f"extraction not finished: {UNITS_WRITTEN} units complete, of a plan not recorded"
    assert cache_main(["verify", str(url)]) == 3
    out = capsys.readouterr()
    assert said in out.out and "no damage found" in out.err and "meta/config.json" in out.err
    assert cache_main(["info", str(url)]) == 0
    assert f"extraction   {said}" in capsys.readouterr().out
    assert cache_main(["info", "--json", str(url)]) == 0
    x = json.loads(capsys.readouterr().out)["extraction"]
    assert (x["status"], x["units_total"], x["units_complete"]) == ("unfinished", None, UNITS_WRITTEN)
    assert _train(url, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert said in err and "loader.allow_unfinished=true" in err and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert _train(url, tmp_path / "run2", "loader.allow_unfinished=true") == 0
    assert (tmp_path / "run2" / "metrics.jsonl").exists()

    _records(url, plan=False, config=False, report=True)  # the old extraction finished: its report
    capsys.readouterr()
    assert cache_main(["verify", str(url)]) == 0
    assert "extraction finished (written before plans were recorded)" in capsys.readouterr().out
    assert _train(url, tmp_path / "run3") == 0


def test_a_cache_without_extraction_records_is_not_called_unfinished(clean, tmp_path, capsys):
    """Written through the library only (no config, plan or report): verify exits 0 and info says completeness
    is up to its writer -- the line between this and the old layout is meta/config.json alone."""
    url = _copy(clean, tmp_path)
    assert cache_main(["verify", str(url)]) == 0
    assert "all checks pass" in capsys.readouterr().out
    assert cache_main(["info", str(url)]) == 0
    assert "extraction   no extraction record (not written by dflash-extract)" in capsys.readouterr().out

"""Each command checks the settings it reads: an extraction setting never stops training.

``dflash-train`` on a cache whose samples are longer than ``extract.tokens_per_batch`` (a preset with
``data.max_length`` above that extraction budget: a long-context cache extracted with its own overrides) trains;
``dflash-extract`` with the same config is still refused, naming the field; training's own budget
(``loader.tokens_per_batch``) is still checked against the cache's real lengths.
"""

from __future__ import annotations

import subprocess
import sys

from fixtures.trainer import CONFIG, MASK_TOKEN_ID, ROOT, run_train, small_cache, train_env

from dflash_cache import open_cache
from dflash_cache.runtime.reference import render
from dflash_cache.runtime.schema import SECTION_READERS, PipelineConfig

# tiny.toml's data.max_length is 512; an extraction budget of 128 tokens is below it (and below the cache's
# longest samples): dflash-extract refuses this config, dflash-train does not read it
EXTRACTION_ONLY = ["extract.tokens_per_batch=128", "cache.bucket_edges=[64, 600]"]
BASE = [f"model.mask_token_id={MASK_TOKEN_ID}", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16", "metrics.tensorboard=false", "train.max_steps=2"]


def test_training_a_cache_longer_than_the_extraction_budget(tmp_path):
    cache = small_cache(str(tmp_path / "cache"), n_samples=24)
    longest = int(open_cache(cache).index().lengths.max())
    assert longest > 128  # samples the extraction budget of the config could not have held

    proc = run_train(BASE, cache, tmp_path / "run", *EXTRACTION_ONLY)
    assert "extract.tokens_per_batch" not in proc.stderr and "bucket_edges" not in proc.stderr
    assert (tmp_path / "run" / "config.json").is_file()
    assert any((tmp_path / "run").rglob("*.safetensors")), sorted(p.name for p in (tmp_path / "run").rglob("*"))

    # training's own budget is still checked, against the cache's real lengths (one line, exit 2)
    low = run_train(BASE, cache, tmp_path / "run2", f"loader.tokens_per_batch={longest - 1}", expect=2)
    assert f"the longest training sample has {longest} tokens but loader.tokens_per_batch={longest - 1}" in low.stderr
    assert "Traceback" not in low.stderr


def test_extraction_still_refuses_the_same_config(tmp_path):
    sets = [a for o in EXTRACTION_ONLY for a in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "extract.cli", str(CONFIG), "--out", str(tmp_path / "c"), *sets],
                          cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "extract.tokens_per_batch: is below data.max_length (512)" in proc.stderr
    assert "cache.bucket_edges: edges [600] are not below data.max_length (512)" in proc.stderr
    assert not (tmp_path / "c").exists()


def test_training_still_checks_its_own_sections_across_them(tmp_path):
    """A check between training's sections (loader.live needs train.max_steps) still refuses the config."""
    proc = subprocess.run([sys.executable, "-m", "train.cli", str(CONFIG), "--cache", str(tmp_path / "none"),
                           "--run-dir", str(tmp_path / "run"), "--set", "loader.live=true"],
                          cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.max_steps: is required when loader.live = true" in proc.stderr


def test_the_reference_names_the_readers_of_every_section():
    assert set(SECTION_READERS) == set(PipelineConfig.model_fields)
    page = render()
    for name, readers in SECTION_READERS.items():
        section = page.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert f"*Read by:* {' '.join(readers.split())}." in section, name

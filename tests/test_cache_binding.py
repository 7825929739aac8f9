"""Training reads only what verify accepts: each shard and small array is bound to its part's commit
record (the shard index's crc32c, the small arrays' crc32c), so swapped shards, a shard left by another
writer and an emptied chunk stop ``dflash-train`` with one clear line (or quarantine the part with
``loader.on_corrupt=skip``), while ``dflash-cache verify`` rejects the same cache."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from fixtures.trainer import run_train, small_cache

from dflash_cache import open_cache
from dflash_cache.cli import main as cli_main

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16", "metrics.tensorboard=false", "train.max_steps=2",
        "checkpoint.every_steps=100000"]


def _cache(tmp_path: Path, seed: int = 0, name: str = "cache") -> Path:
    return Path(small_cache(str(tmp_path / name), n_samples=32, seed=seed, samples_per_part=6))


def _two_parts_of_one_bucket(url: Path):
    parts = open_cache(str(url)).parts()
    for a in parts:
        for b in parts:
            if a.key < b.key and a.bucket == b.bucket:
                return a, b
    raise AssertionError("the synthetic cache has no bucket with two parts")


def _swap_shards(url: Path) -> str:
    a, b = _two_parts_of_one_bucket(url)
    fa, fb = url / a.data_key / "features/c/0/0", url / b.data_key / "features/c/0/0"
    tmp = fa.with_name("swap")
    fa.rename(tmp)
    fb.rename(fa)
    tmp.rename(fb)
    return a.key


def _foreign_shard(url: Path, tmp_path: Path) -> str:
    """The shard of the same part as another writer (another seed: other features) wrote it."""
    other = _cache(tmp_path, seed=7, name="other")
    part = open_cache(str(url)).parts()[0]
    shutil.copyfile(other / open_cache(str(other)).parts()[0].data_key / "features/c/0/0",
                    url / part.data_key / "features/c/0/0")
    return part.key


def _empty_small_chunk(url: Path) -> str:
    part = open_cache(str(url)).parts()[0]
    (url / part.data_key / "input_ids/c/0").write_bytes(b"")
    return part.key


def _edited_record(url: Path, array: str) -> str:
    """The commit record's inline copy of ``offsets`` (a sample boundary moved by one token) or
    ``sample_ids`` (an id changed) edited, with the copy's crc32c recomputed to match: the record agrees with
    itself, only the stored array tells."""
    part = open_cache(str(url)).parts()[0]
    path = url / part.key / "commit.json"
    rec = json.loads(path.read_text())
    a = rec["arrays"][array]
    values = np.frombuffer(base64.b64decode(a["inline"]), dtype="<i8").copy()
    values[1] += 1 if array == "offsets" else 10_000
    a["inline"] = base64.b64encode(values.astype("<i8").tobytes()).decode()
    a["crc32c"] = google_crc32c.value(values.astype(a["dtype"]).tobytes())
    path.write_text(json.dumps(rec, indent=1))
    return part.key


@pytest.mark.parametrize("damage", ["swapped_shards", "foreign_shard", "empty_small_chunk", "edited_offsets",
                                    "edited_sample_ids"])
def test_training_refuses_what_verify_rejects(tmp_path, capsys, damage):
    url = _cache(tmp_path)
    key = {"swapped_shards": lambda: _swap_shards(url), "foreign_shard": lambda: _foreign_shard(url, tmp_path),
           "empty_small_chunk": lambda: _empty_small_chunk(url),
           "edited_offsets": lambda: _edited_record(url, "offsets"),
           "edited_sample_ids": lambda: _edited_record(url, "sample_ids")}[damage]()
    assert cli_main(["verify", str(url)]) == 2
    assert key in capsys.readouterr().err
    proc = run_train(BASE, str(url), tmp_path / "run", expect=2)
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and key in last, proc.stderr[-2000:]
    # the user's choice: quarantine the part, train on the rest, count it
    proc = run_train(BASE, str(url), tmp_path / "run-skip", "loader.on_corrupt=skip")
    assert f"quarantined part {key}" in proc.stderr


def test_a_swapped_shard_is_named_as_not_the_parts_own(tmp_path):
    url = _cache(tmp_path)
    key = _swap_shards(url)
    cache = open_cache(str(url))
    part = next(p for p in cache.parts() if p.key == key)
    with pytest.raises(Exception, match="not the one its commit record names") as err:
        cache.read_rows(part, [0])
    assert getattr(err.value, "part", None) == key

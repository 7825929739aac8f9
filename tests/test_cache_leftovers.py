"""What writers leave behind inside a part: unknown files in a committed part are listed by verify (one line
each) and ignored by training; a generation sealed for its commit whose writer stopped before the commit
record is resolved by the part's next lease holder (committed when it verifies, removed otherwise)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fixtures.trainer import ROOT, run_train, small_cache

from dflash_cache import lease as lease_mod
from dflash_cache import open_cache, verify_cache
from dflash_cache import writer as writer_mod
from dflash_cache.cli import main as cli_main
from dflash_cache.lease import PartCommittedError, acquire
from dflash_cache.synthetic import make_synthetic_cache, synthetic_features

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.tokens_per_batch=512",
        "train.num_anchors=16", "metrics.tensorboard=false", "train.max_steps=2", "checkpoint.every_steps=100000",
        "loader.holdout_fraction=0.0"]


# -- unknown files inside committed parts ----------------------------------------------------------------


def test_unknown_files_inside_a_committed_part_are_listed_one_per_line_and_training_ignores_them(tmp_path, capsys):
    url = Path(small_cache(str(tmp_path / "cache"), n_samples=32, samples_per_part=6))
    part = open_cache(str(url)).parts()[0]
    gen = url / part.data_key
    (gen / "extra.bin").write_bytes(b"not the part's")  # an extra file in the committed generation
    (gen / "features" / "c" / "99").mkdir(parents=True)
    (gen / "features" / "c" / "99" / "0").write_bytes(b"x")  # a chunk outside the array's extent
    (gen / "sample_ids" / "c" / "0.1f2e.partial").write_bytes(b"x")  # an interrupted write of zarr's store
    (url / part.key / "notes.txt").write_text("mine")  # a file next to the generation
    (url / part.key / "g000007").mkdir()  # a generation the commit record does not name
    (url / part.key / "g000007" / "zarr.json").write_text("{}")

    assert cli_main(["verify", str(url)]) == 0
    out = capsys.readouterr().out
    unknown = [f"{part.data_key}/extra.bin", f"{part.data_key}/features/c/99/0",
               f"{part.data_key}/sample_ids/c/0.1f2e.partial", f"{part.key}/notes.txt"]
    for key in unknown:
        lines = [ln for ln in out.splitlines() if ln.strip().startswith(f"{key}:")]
        assert len(lines) == 1 and "not named by the part's commit record" in lines[0] and "leaves it" in lines[0], out
    gen_line = [ln for ln in out.splitlines() if ln.strip().startswith(f"{part.key}/g000007:")]
    assert len(gen_line) == 1 and "`dflash-cache gc` removes it" in gen_line[0], out
    report = verify_cache(str(url))
    assert sorted(report.unknown) == sorted(unknown) and report.garbage == [f"{part.key}/g000007"]
    assert "4 unknown file(s) in committed parts ignored by readers" in report.summary()

    run_train(BASE, str(url), tmp_path / "run")  # training reads only what the commit record names

    assert cli_main(["gc", str(url)]) == 0
    assert f"{part.key}/g000007" in capsys.readouterr().out
    assert not (url / part.key / "g000007").exists() and (gen / "extra.bin").exists()  # committed data untouched
    assert verify_cache(str(url)).garbage == []


def test_a_clean_cache_has_no_unknown_files(tmp_path):
    url = small_cache(str(tmp_path / "cache"), n_samples=16, samples_per_part=6, codec="fp8-e4m3")
    report = verify_cache(url)
    assert report.ok and report.unknown == [] and report.leftovers() == []


# -- sealed but uncommitted generations ------------------------------------------------------------------


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = tmp_path / "c"
    make_synthetic_cache(str(url), 12, lengths=[40 + i for i in range(12)], samples_per_part=6,
                         bucket_edges=(64, 128), chunk_tokens=16, shard_tokens=64, seed=3)
    return url


def _features(first_id: int, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(first_id)
    return [synthetic_features(70, 3, 64, g) for _ in range(n)]


def _fill(w, first_id: int, n: int = 3) -> None:
    for i, f in enumerate(_features(first_id, n)):
        w.add(first_id + i, torch.arange(70), torch.ones(70, dtype=torch.bool), f)


# A writer that dies (SIGKILL) exactly when it creates its commit record: after its seal.
_DIES_AT_COMMIT = textwrap.dedent("""
    import os, signal, sys, torch
    from dflash_cache import open_cache
    from dflash_cache.synthetic import synthetic_features

    cache = open_cache(sys.argv[1])
    real = cache.storage.create_exclusive

    def dying(key, data, durable=False):
        if key.endswith("/commit.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(key, data, durable)

    cache.storage.create_exclusive = dying
    w = cache.part_writer(1, "sealed", meta={"note": "x"})
    g = torch.Generator().manual_seed(7000)
    for i in range(3):
        w.add(7000 + i, torch.arange(70), torch.ones(70, dtype=torch.bool), synthetic_features(70, 3, 64, g))
    w.commit()
""")


def _writer_dies_between_seal_and_commit(url: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", _DIES_AT_COMMIT, str(url)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    key = "buckets/1/sealed"
    names = sorted(os.listdir(url / key))
    gen = _gen_dir(url / key)
    assert "commit.json" not in names and f"{gen}.seal" in names and gen in names, names
    assert (url / key / f"{gen}.seal").read_bytes().startswith(b"commit\n{")  # the seal carries the record
    return key


def _gen_dir(part: Path) -> str:
    """The one generation directory of a part (``g000001-<writer token>``)."""
    gens = [p.name for p in part.iterdir() if p.is_dir() and re.fullmatch(r"g000001-[0-9a-f]{16}", p.name)]
    assert len(gens) == 1, sorted(os.listdir(part))
    return gens[0]


def _assert_committed_as_written(url: Path, key: str) -> None:
    report = verify_cache(str(url))
    assert report.ok and report.n_samples == 15 and key not in report.uncommitted and report.leftovers() == []
    got = open_cache(str(url)).read_samples([7000, 7001, 7002])
    assert all(torch.equal(s.features, f) for s, f in zip(got, _features(7000), strict=True))
    assert not [n for n in os.listdir(url / key) if n.startswith("lease.")]


def test_gc_commits_a_sealed_generation_whose_writer_died_before_its_commit_record(cache_dir, capsys, caplog):
    key = _writer_dies_between_seal_and_commit(cache_dir)
    gen = _gen_dir(cache_dir / key)
    assert cli_main(["verify", str(cache_dir)]) == 0  # invisible to readers until resolved; listed
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith(f"{key}:")]
    assert len(said) == 1 and "sealed a generation for its commit" in said[0] and "dflash-cache gc" in said[0]
    with caplog.at_level(logging.WARNING, logger="dflash_cache.recover"):
        assert cli_main(["gc", str(cache_dir)]) == 0
    said = capsys.readouterr()
    assert f"part {key}: committed generation {gen}, which its writer sealed" in said.err + caplog.text
    assert "removed 0 uncommitted part(s)" in said.out
    _assert_committed_as_written(cache_dir, key)


def test_a_rerun_of_the_part_finds_it_committed_from_the_seal(cache_dir):
    key = _writer_dies_between_seal_and_commit(cache_dir)
    with pytest.raises(PartCommittedError):
        open_cache(str(cache_dir)).part_writer(1, "sealed")  # the takeover resolves it: nothing to rewrite
    _assert_committed_as_written(cache_dir, key)


def test_a_sealed_generation_that_does_not_verify_is_removed_and_the_part_rewritten(cache_dir, capsys, caplog):
    key = _writer_dies_between_seal_and_commit(cache_dir)
    gen = _gen_dir(cache_dir / key)
    shard = cache_dir / key / gen / "features" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # damaged after its writer sealed it
    shard.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="dflash_cache.recover"):
        assert cli_main(["gc", str(cache_dir)]) == 0
    said = capsys.readouterr()
    assert f"part {key}: removing generation {gen}" in said.err + caplog.text and key in said.out
    assert not (cache_dir / key).exists()  # nothing of it is left
    assert verify_cache(str(cache_dir)).uncommitted == []
    with open_cache(str(cache_dir)).part_writer(1, "sealed") as w:  # the rerun writes it again
        _fill(w, 7000)
    _assert_committed_as_written(cache_dir, key)


def test_a_frozen_writer_whose_sealed_generation_was_committed_meanwhile_reports_success(cache_dir, monkeypatch):
    cache = open_cache(str(cache_dir))
    w = cache.part_writer(1, "sealed")
    _fill(w, 7000)
    real = writer_mod.seal_for_commit
    taken = {}

    def seal_then_freeze(storage, key, gen, record=b""):
        ok = real(storage, key, gen, record)
        lease_mod._keeper.drop(w._lease)  # frozen right after its seal: its lease turns stale
        with pytest.raises(PartCommittedError):  # the next holder commits the sealed generation
            acquire(storage, key)
        taken["committed"] = (cache_dir / key / "commit.json").exists()
        return ok

    monkeypatch.setattr(writer_mod, "seal_for_commit", seal_then_freeze)
    info = w.commit()  # resumed: the record names its own generation, so its commit stands
    assert taken == {"committed": True} and info.generation == 1
    _assert_committed_as_written(cache_dir, w.key)

"""``dflash-cache verify`` on a cache made by ``dflash-extract``: every corruption a reader would trust
is caught, every bad part is listed once, and the loader quarantines (on_corrupt=skip) parts whose
commit record or small arrays are bad."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_cache import open_cache, verify_cache
from dflash_cache.cli import main as cache_main
from dflash_cache.errors import CacheCorruptError
from extract.cli import main as extract_main
from train.config import LoaderConfig
from train.data.loader import StreamingLoader

ROOT = Path(__file__).resolve().parents[1]
N, UNIT = 40, 8


@pytest.fixture(scope="module")
def extracted(tiny_teacher_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "cache"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert extract_main(["configs/tiny.toml", "--out", str(out), "--no-progress", "--set",
                             f"teacher.path={tiny_teacher_dir}", "--set", f"data.path=builtin:tiny-chat?n={N}",
                             "--set", f"extract.unit_size={UNIT}", "--set", "extract.tokens_per_batch=1024"]) == 0
    finally:
        os.chdir(cwd)
    return out


@pytest.fixture()
def cache(extracted, tmp_path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(extracted, copy)
    return copy


def _parts(url: Path) -> dict[int, list]:
    """unit -> its committed parts."""
    out: dict[int, list] = {}
    for p in open_cache(str(url)).scan_parts()[0]:
        out.setdefault(p.meta["unit"], []).append(p)
    return out


def _verify(url: Path, capsys) -> tuple[int, list[str]]:
    """Exit code of ``dflash-cache verify`` and its problem lines."""
    capsys.readouterr()
    rc = cache_main(["verify", str(url)])
    err = capsys.readouterr().err
    return rc, [line.strip() for line in err.splitlines() if line.startswith("  ")]


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_the_extracted_cache_verifies(cache, capsys):
    assert all(len(ps) == 2 for ps in _parts(cache).values())  # every unit spans two buckets here
    rc, lines = _verify(cache, capsys)
    assert (rc, lines) == (0, [])
    rec = open_cache(str(cache)).head_record()
    assert rec["nbytes"] == (cache / "head.safetensors").stat().st_size


# Each case damages the cache the way an operator saw it happen; verify must name what is wrong.
def _flipped_head(c: Path) -> str:
    _flip(c / "head.safetensors", (c / "head.safetensors").stat().st_size - 100)  # inside a tensor: still parses
    return "head.safetensors: head.safetensors does not match its checksum"


def _missing_head(c: Path) -> str:
    (c / "head.safetensors").unlink()
    return "head.safetensors: head.safetensors is missing"


def _unrecorded_head(c: Path) -> str:
    meta = json.loads((c / "zarr.json").read_text())
    del meta["attributes"]["dflash_cache"]["head"]
    (c / "zarr.json").write_text(json.dumps(meta))
    return "head.safetensors: head.safetensors has no checksum"


def _lost_commit(c: Path) -> str:
    p = _parts(c)[1][0]
    (c / p.key / "commit.json").unlink()
    return f"part {p.key}, array commit.json: work unit 1 is incomplete: 1 of its 2 parts"


def _lost_whole_unit(c: Path) -> list[str]:
    parts = _parts(c)[2]
    for p in parts:
        (c / p.key / "commit.json").unlink()
    return [f"part {p.key}, array commit.json: work unit 2 is incomplete: this part has no commit record"
            for p in parts]


def _removed_unit(c: Path) -> str:
    for p in _parts(c)[3]:
        shutil.rmtree(c / p.key)
    return "meta/extract_report.json: the finished extraction counted 40 samples in the cache, its committed parts " \
           "hold"


def _garbled_commit(c: Path) -> str:
    p = _parts(c)[4][0]
    (c / p.key / "commit.json").write_text("{ not json")
    return f"part {p.key}, array commit.json: commit record commit.json is unreadable"


def _missing_small_array(c: Path) -> str:
    p = _parts(c)[0][1]
    shutil.rmtree(c / p.data_key / "sample_ids")
    return f"part {p.key}, array sample_ids: zarr.json is missing"


def _missing_token_array(c: Path) -> str:
    """A small array the trainer reads (sample_ids and offsets it takes from the commit record's copies,
    which verify compares with the stored arrays)."""
    p = _parts(c)[0][1]
    shutil.rmtree(c / p.data_key / "input_ids")
    return f"part {p.key}, array input_ids: zarr.json is missing"


def _flipped_feature(c: Path) -> str:
    p = _parts(c)[0][0]
    _flip(c / p.data_key / "features" / "c" / "0" / "0", 40)
    return f"part {p.key}, array features:"


CASES = [_flipped_head, _missing_head, _unrecorded_head, _lost_commit, _lost_whole_unit, _removed_unit,
         _garbled_commit, _missing_small_array, _flipped_feature]


@pytest.mark.parametrize("damage", CASES, ids=lambda f: f.__name__.strip("_"))
def test_each_corruption_is_caught(cache, capsys, damage):
    want = damage(cache)
    wants = want if isinstance(want, list) else [want]
    rc, lines = _verify(cache, capsys)
    assert rc == 2 and len(lines) == len(wants), lines
    for line, w in zip(sorted(lines), sorted(wants), strict=True):
        assert line.startswith(w) and "rerun dflash-extract" in line, line  # names it and says what to do


def test_every_bad_part_is_listed_once(cache, capsys):
    wants = [damage(cache) for damage in (_flipped_head, _lost_commit, _garbled_commit, _missing_small_array,
                                          _flipped_feature)] + _lost_whole_unit(cache)
    rc, lines = _verify(cache, capsys)
    assert rc == 2 and len(lines) == len(wants)
    for want in wants:
        assert sum(line.startswith(want) for line in lines) == 1, (want, lines)
    named = [line.split(",")[0] for line in lines]
    assert len(named) == len(set(named)), "a part is named twice"
    with pytest.raises(CacheCorruptError, match="verify found 7 problem"):
        verify_cache(str(cache))


@pytest.mark.parametrize("damage", [_flipped_head, _missing_head])
def test_load_head_refuses_a_damaged_head(cache, damage):
    damage(cache)
    with pytest.raises(CacheCorruptError, match="head.safetensors"):
        open_cache(str(cache)).load_head()


def test_loader_quarantines_parts_with_a_bad_commit_record_or_small_arrays(cache):
    idx = open_cache(str(cache)).index()
    ids_in = {p.key: set(idx.sample_ids[idx.part == i].tolist()) for i, p in enumerate(idx.parts)}
    bad = sorted([_garbled_commit(cache).split(",")[0][5:], _missing_token_array(cache).split(",")[0][5:]])
    cfg = {"tokens_per_batch": 1024, "num_readers": 2, "max_buffer_bytes": 1 << 24, "holdout_fraction": 0.0}
    c = open_cache(str(cache))
    with pytest.raises(CacheCorruptError):
        StreamingLoader(c, LoaderConfig(**cfg), seed=0, num_anchors=8, block_size=4, max_epochs=1)
    with StreamingLoader(c, LoaderConfig(**cfg, on_corrupt="skip"), seed=0, num_anchors=8, block_size=4,
                         max_epochs=1) as loader:
        seen = [i for b in loader for i in b.sample_ids.tolist()]
        assert loader.counters.quarantined_parts == bad
    assert len(seen) == len(set(seen))
    assert set(seen) == set(range(N)) - ids_in[bad[0]] - ids_in[bad[1]]  # exactly the good parts' samples

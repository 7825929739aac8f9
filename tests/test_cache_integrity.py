"""Bad input, crashes and concurrency: each gives a clear error or leaves no visible damage."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_cache import open_cache, verify_cache
from dflash_cache.cli import main as cli_main
from dflash_cache.errors import CacheCorruptError, CacheNotFoundError, NotACacheError, SampleNotFoundError
from dflash_cache.storage import LocalStorage
from dflash_cache.synthetic import make_synthetic_cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    url = tmp_path / "c"
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")  # the writers under test below fsync
    make_synthetic_cache(str(url), 40, lengths=[40 + 3 * i for i in range(40)], samples_per_part=20,
                         bucket_edges=(64, 128), chunk_tokens=16, shard_tokens=64, seed=3)
    monkeypatch.delenv("DFLASH_CACHE_FSYNC")
    return url


def _first_part(url: Path):
    return open_cache(str(url)).parts()[0]


def _shard(url: Path, part, i: int = 0) -> Path:
    return url / part.data_key / "features" / "c" / str(i) / "0"


def _assert_verify_names(url: Path, part_key: str, array: str, capsys) -> None:
    with pytest.raises(CacheCorruptError) as err:
        verify_cache(str(url))
    assert err.value.part == part_key and err.value.array == array
    assert cli_main(["verify", str(url)]) == 2
    msg = capsys.readouterr().err
    assert part_key in msg and array in msg
    assert msg.count(f"part {part_key}") == 1 and "dflash-cache verify" not in msg  # named once; no "run verify"


def test_clean_cache_verifies(cache_dir, capsys):
    report = verify_cache(str(cache_dir))
    assert (report.n_samples, report.ok, report.uncommitted) == (40, True, [])
    assert cli_main(["verify", str(cache_dir)]) == 0
    assert "40 samples" in capsys.readouterr().out


def test_info_reads_as_text(cache_dir, capsys):
    assert cli_main(["info", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("teacher ") and "None" not in out  # an unset revision is left out, not printed as None
    assert "40 samples" not in out and "samples      40" in out


def test_truncated_chunk_file(cache_dir, capsys):
    part = _first_part(cache_dir)
    shard = _shard(cache_dir, part)
    shard.write_bytes(shard.read_bytes()[:-(16 * 4 + 4 + 10)])  # the index (4 chunks) and 10 bytes of the last chunk
    cache = open_cache(str(cache_dir))
    # the reader takes the shard's index from the commit record: the last chunk's bytes are cut short
    with pytest.raises(CacheCorruptError, match="truncated"):
        cache.read_rows(part, list(range(part.n_samples)))
    _assert_verify_names(cache_dir, part.key, "features", capsys)


def test_damaged_shard_index_is_named_by_verify(cache_dir, capsys):
    """Readers take a shard's index from the commit record's chunk table; verify reads the shard's own."""
    part = _first_part(cache_dir)
    shard = _shard(cache_dir, part)
    shard.write_bytes(shard.read_bytes()[:-37])  # within the index (4 chunks: 68 bytes)
    cache = open_cache(str(cache_dir))
    assert len(cache.read_rows(part, list(range(part.n_samples)))) == part.n_samples  # chunks intact
    with pytest.raises(CacheCorruptError, match="truncated or its index checksum fails"):
        verify_cache(str(cache_dir))
    _assert_verify_names(cache_dir, part.key, "features", capsys)


@pytest.mark.parametrize("field", ["shard_chunks", "inline"])
def test_a_damaged_copy_in_the_commit_record_is_refused(cache_dir, field):
    part = _first_part(cache_dir)
    path = cache_dir / part.key / "commit.json"
    rec = json.loads(path.read_bytes())
    arr = rec["arrays"]["features" if field == "shard_chunks" else "offsets"]
    if field == "shard_chunks":
        raw = bytearray(base64.b64decode(arr["shard_chunks"][0]))
        raw[0] ^= 1  # the first chunk's size
        arr["shard_chunks"][0] = base64.b64encode(bytes(raw)).decode()
    else:
        raw = bytearray(base64.b64decode(arr["inline"]))
        raw[8] ^= 1  # the second offset
        arr["inline"] = base64.b64encode(bytes(raw)).decode()
    path.write_text(json.dumps(rec, indent=1))
    want = "chunk table of shard 0 disagrees" if field == "shard_chunks" else "copy of the array differs"
    cache = open_cache(str(cache_dir))
    with pytest.raises(CacheCorruptError, match=want) as err:
        cache.read_rows(next(p for p in cache.parts() if p.key == part.key), [0])
    assert err.value.part == part.key


def part_first_id(url: Path, part) -> int:
    idx = open_cache(str(url)).index()
    return int(idx.sample_ids[(idx.part == idx.parts.index(part)) & (idx.row == 0)][0])


def test_flipped_byte(cache_dir, capsys):
    part = _first_part(cache_dir)
    shard = _shard(cache_dir, part)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match="checksum") as err:
        open_cache(str(cache_dir)).read_samples([part_first_id(cache_dir, part)])
    assert err.value.part == part.key and err.value.array == "features"
    _assert_verify_names(cache_dir, part.key, "features", capsys)


def test_missing_commit_record(cache_dir):
    cache = open_cache(str(cache_dir))
    part = cache.parts()[0]
    sid = part_first_id(cache_dir, part)
    (cache_dir / part.key / "commit.json").unlink()
    cache = open_cache(str(cache_dir))
    assert part.key not in [p.key for p in cache.parts()]
    assert cache.uncommitted() == [part.key]
    with pytest.raises(SampleNotFoundError, match=f"sample ids \\[{sid}\\] are not in any committed part"):
        cache.read_sample(sid)
    assert verify_cache(str(cache_dir)).uncommitted == [part.key]


def test_commit_record_counts_disagree(cache_dir, capsys):
    part = _first_part(cache_dir)
    rec_path = cache_dir / part.key / "commit.json"
    rec = json.loads(rec_path.read_text())
    rec["n_samples"] += 1
    rec_path.write_text(json.dumps(rec))
    with pytest.raises(CacheCorruptError, match="disagrees") as err:
        open_cache(str(cache_dir)).parts()
    assert (err.value.part, err.value.array) == (part.key, "commit.json")
    assert cli_main(["verify", str(cache_dir)]) == 2
    assert part.key in capsys.readouterr().err


def test_checksum_in_record_disagrees(cache_dir, capsys):
    part = _first_part(cache_dir)
    rec_path = cache_dir / part.key / "commit.json"
    rec = json.loads(rec_path.read_text())
    rec["arrays"]["input_ids"]["crc32c"] ^= 1
    rec_path.write_text(json.dumps(rec))
    _assert_verify_names(cache_dir, part.key, "input_ids", capsys)


def test_duplicate_sample_ids_in_two_parts(tmp_path, capsys):
    url = str(tmp_path / "c")
    make_synthetic_cache(url, 10, lengths=[50] * 10, bucket_edges=(64,), seed=1)
    make_synthetic_cache(url, 10, lengths=[50] * 10, bucket_edges=(64,), seed=2, first_id=5)
    with pytest.raises(CacheCorruptError, match="sample id 5 appears in two places") as err:
        open_cache(url).index()
    assert err.value.array == "sample_ids"
    with pytest.raises(CacheCorruptError, match="also in part buckets/0/syn1-b0-p00000") as err:
        verify_cache(url)
    assert err.value.part == "buckets/0/syn2-b0-p00000"
    assert cli_main(["verify", url]) == 2
    assert "sample_ids" in capsys.readouterr().err


def test_nonexistent_path(tmp_path, capsys):
    with pytest.raises(CacheNotFoundError, match="does not exist"):
        open_cache(str(tmp_path / "nope"))
    assert cli_main(["info", str(tmp_path / "nope")]) == 2
    assert "no cache at" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["empty-dir", "other-files", "plain-zarr", "a-file", "bad-json"])
def test_path_that_is_not_a_cache(tmp_path, kind, capsys):
    p = tmp_path / "x"
    if kind == "a-file":
        p.write_text("hello")
    else:
        p.mkdir()
    if kind == "other-files":
        (p / "data.txt").write_text("x")
    if kind == "plain-zarr":
        (p / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    if kind == "bad-json":
        (p / "zarr.json").write_text("{not json")
    with pytest.raises(NotACacheError, match="not a dflash cache"):
        open_cache(str(p))
    assert cli_main(["info", str(p)]) == 2
    assert "not a dflash cache" in capsys.readouterr().err


def test_newer_format_is_refused(cache_dir):
    meta = json.loads((cache_dir / "zarr.json").read_text())
    meta["attributes"]["dflash_cache"]["format_version"] = 99
    (cache_dir / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match="format 99, newer than"):
        open_cache(str(cache_dir))


class CountingStorage(LocalStorage):
    """Records every key read."""

    def __init__(self, url: str):
        super().__init__(url)
        self.reads: list[str] = []

    def get(self, key):
        self.reads.append(key)
        return super().get(key)

    def get_range(self, key, start, end):
        self.reads.append(key)
        return super().get_range(key, start, end)

    def open_range(self, key, start, end):
        self.reads.append(key)
        return super().open_range(key, start, end)

    def get_suffix(self, key, n):
        self.reads.append(key)
        return super().get_suffix(key, n)


def test_index_reads_no_feature_chunk(cache_dir):
    st = CountingStorage(str(cache_dir))
    cache = open_cache(str(cache_dir), storage=st)
    idx = cache.index()
    assert len(idx) == 40 and sorted(idx.lengths.tolist()) == [40 + 3 * i for i in range(40)]
    # sample_ids and offsets come from the commit records' copies: nothing but records is read
    assert st.reads and not [k for k in st.reads if not k.endswith("commit.json") and not k.endswith("zarr.json")]
    cache.read_sample(int(idx.sample_ids[0]))  # the counter does see feature reads
    assert [k for k in st.reads if "/features/" in k]


_KILL_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from dflash_cache import open_cache
    from dflash_cache.synthetic import synthetic_features
    cache = open_cache(sys.argv[1])
    w = cache.part_writer(1, "victim", meta={"unit": 7})
    g = torch.Generator().manual_seed(0)
    for i in range(10**6):
        w.add(10_000 + i, torch.zeros(100, dtype=torch.long), torch.ones(100, dtype=torch.bool),
              synthetic_features(100, 3, 64, g))
        if w.n_tokens >= 200:  # at least two whole shards (64 tokens) are on disk
            print("written", flush=True)
            time.sleep(0.01)
""")


def test_sigkilled_writer_leaves_no_visible_part(cache_dir, capsys):
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(cache_dir)], stdout=subprocess.PIPE,
                            cwd=ROOT, text=True)
    assert proc.stdout.readline().strip() == "written"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cache = open_cache(str(cache_dir))
    key = "buckets/1/victim"
    assert len(list((cache_dir / key).glob("g000001-*/features"))) == 1  # data was on disk ...
    assert key not in [p.key for p in cache.parts()]  # ... but no visible part
    assert cache.uncommitted() == [key]
    assert len(cache.index()) == 40
    report = verify_cache(str(cache_dir), raise_on_error=False)  # the unit it belonged to is incomplete:
    assert report.ok and not report.finished  # unfinished (resumable), not damage
    assert [ln for ln in report.unfinished if ln.startswith(f"{key}: work unit 7 is incomplete")] == report.unfinished
    assert len(report.unfinished) == 1
    assert cli_main(["verify", str(cache_dir)]) == 3
    assert cli_main(["gc", str(cache_dir)]) == 0
    assert key in capsys.readouterr().out
    assert not (cache_dir / key).exists() and open_cache(str(cache_dir)).uncommitted() == []
    assert verify_cache(str(cache_dir)).ok


def test_gc_keeps_a_live_writer(cache_dir):
    cache = open_cache(str(cache_dir))
    w = cache.part_writer(0, "live")
    assert cache.uncommitted() == ["buckets/0/live"]
    assert cache.gc() == []  # its writer (this process) is alive
    w.abort()
    assert cache.uncommitted() == []


_WRITER_SCRIPT = textwrap.dedent("""
    import sys, torch
    from dflash_cache import open_cache
    from dflash_cache.synthetic import synthetic_features
    cache = open_cache(sys.argv[1]); rank = int(sys.argv[2])
    g = torch.Generator().manual_seed(rank)
    for p in range(3):
        with cache.part_writer(1, f"r{rank}-p{p}", meta={"rank": rank}) as w:
            for i in range(6):
                t = 70 + i
                w.add(100_000 * (rank + 1) + 10 * p + i, torch.arange(t), torch.ones(t, dtype=torch.bool),
                      synthetic_features(t, 3, 64, g))
""")


def test_two_processes_write_one_cache(cache_dir):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER_SCRIPT, str(cache_dir), str(r)], cwd=ROOT)
             for r in range(2)]
    # waits on the children's exit; the deadline is generous: `import torch` alone took 31 s at load 20
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    report = verify_cache(str(cache_dir))
    assert report.n_parts == 4 + 6 and report.n_samples == 40 + 36
    cache = open_cache(str(cache_dir))
    assert len(cache.index()) == 76
    metas = sorted(p.meta["rank"] for p in cache.parts() if "rank" in p.meta)
    assert metas == [0, 0, 0, 1, 1, 1]


def test_info_json_has_exactly_the_documented_keys(cache_dir, capsys):
    (cache_dir / "buckets/0/leftover").mkdir()
    assert cli_main(["info", str(cache_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {"n_samples", "n_tokens", "bytes_per_token", "raw_bytes_per_token", "buckets", "codec",
                         "target_layer_ids", "mask_token_id", "mask_token_source", "fingerprint", "uncommitted_parts",
                         "final_hidden", "extraction"}
    # a synthetic cache: not written by dflash-extract, so no claim either way about its completeness
    assert info["extraction"] == {"status": "none", "units_total": None, "units_complete": 0,
                                  "summary": "no extraction record (not written by dflash-extract): completeness is "
                                             "up to its writer"}
    assert info["final_hidden"] is False  # (no final normed state stored: cache.store_final_hidden off)
    assert info["n_samples"] == 40 and info["n_tokens"] == sum(40 + 3 * i for i in range(40))
    assert info["raw_bytes_per_token"] == 2 * 3 * 64 and 0 < info["bytes_per_token"] < info["raw_bytes_per_token"]
    assert [(b["lo"], b["hi"], b["n_samples"]) for b in info["buckets"]] == [(0, 64, 9), (64, 128, 21), (128, 512, 10)]
    assert info["uncommitted_parts"] == ["buckets/0/leftover"]
    assert info["fingerprint"] == open_cache(str(cache_dir)).spec.fingerprint
    assert cli_main(["info", str(cache_dir)]) == 0
    assert "uncommitted  1: buckets/0/leftover" in capsys.readouterr().out

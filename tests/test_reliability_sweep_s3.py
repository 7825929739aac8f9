"""The reliability sweep's cache cases on object storage: the damaged cache (built and damaged as in
tests/test_reliability_sweep.py and tests/test_cache_binding.py, then uploaded) is read from a loopback moto
S3 server, where listings, missing objects and ranged reads go through s3fs. Each case ends as on a local disk:
one clear line and the documented exit code, and nothing that verify rejects is trained on."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from fixtures.trainer import run_train  # noqa: E402
from test_cache_binding import _swap_shards  # noqa: E402
from test_reliability_sweep import BASE, _cache, _one_line_error  # noqa: E402
from test_s3_store import s3  # noqa: E402,F401  (the loopback server, a module fixture)

from dflash_cache import create_cache, open_cache, verify_cache  # noqa: E402
from dflash_cache.cli import main as cli_main  # noqa: E402

TRAIN = [*BASE, "loader.holdout_fraction=0.0"]


def _upload(s3, local, name: str) -> str:  # noqa: F811
    s3.put(str(local).rstrip("/") + "/", f"dflash-test/{name}", recursive=True)
    s3.invalidate_cache()
    return f"s3://dflash-test/{name}"


def test_s3_a_stray_object_in_a_bucket_prefix_is_listed_and_ignored(s3, tmp_path, capsys):  # noqa: F811
    local = _cache(tmp_path)
    (local / "buckets" / "0" / "notes.txt").write_text("not a part")
    url = _upload(s3, local, "stray")
    assert cli_main(["verify", url]) == 0
    assert "1 stray file(s) ignored by readers: buckets/0/notes.txt" in capsys.readouterr().out
    assert cli_main(["gc", url]) == 0 and s3.exists("dflash-test/stray/buckets/0/notes.txt")  # not gc's to remove
    run_train(TRAIN, url, tmp_path / "run")


def test_s3_swapped_shards_fail_verify_and_stop_training(s3, tmp_path, capsys):  # noqa: F811
    local = _cache(tmp_path)
    key = _swap_shards(local)
    url = _upload(s3, local, "swapped")
    assert cli_main(["verify", url]) == 2
    assert key in capsys.readouterr().err
    last = _one_line_error(run_train(TRAIN, url, tmp_path / "run", expect=2))
    assert key in last


def test_s3_a_missing_bucket_group_document_fails_verify_and_a_rerun_restores_it(s3, tmp_path, capsys):  # noqa: F811
    local = _cache(tmp_path)
    (local / "buckets" / "1" / "zarr.json").unlink()
    url = _upload(s3, local, "nogroup")
    assert cli_main(["verify", url]) == 2
    err = capsys.readouterr().err
    assert "buckets/1/zarr.json: missing" in err and "Traceback" not in err
    cache = open_cache(url)
    create_cache(url, cache.spec, chunk_tokens=cache.chunk_tokens, shard_tokens=cache.shard_tokens)
    assert verify_cache(url).ok


@pytest.mark.parametrize("record", ["unreadable", "other_fingerprint"])
def test_s3_a_bad_commit_record_is_refused_by_reader_and_verify_and_skipped_on_request(s3, tmp_path, capsys,  # noqa: F811
                                                                                        record):
    local = _cache(tmp_path)
    part = open_cache(str(local)).parts()[0]
    rec_path = local / part.key / "commit.json"
    if record == "unreadable":
        rec_path.write_text("{ not json")
    else:
        rec = json.loads(rec_path.read_text())
        rec["cache_fingerprint"] = "0123456789abcdef"
        rec_path.write_text(json.dumps(rec))
    url = _upload(s3, local, f"record-{record}")
    parts, bad = open_cache(url).scan_parts()
    assert part.key not in [p.key for p in parts] and bad[0].part == part.key
    assert cli_main(["verify", url]) == 2
    err = capsys.readouterr().err
    assert part.key in err and "Traceback" not in err
    if record == "other_fingerprint":
        assert "written for cache fingerprint 0123456789abcdef" in err
    _one_line_error(run_train(TRAIN, url, tmp_path / "run", expect=2))
    if record == "unreadable":  # (the same skip rule for both: one run shows it holds on S3)
        proc = run_train(TRAIN, url, tmp_path / "run-skip", "loader.on_corrupt=skip")
        assert f"quarantined part {part.key}" in proc.stderr

"""The reliability sweep, as tests: each case ends with one clear line and the documented exit code (or is
read correctly), never a traceback, and nothing that verify rejects is trained on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.trainer import CONFIG, ROOT, run_train, small_cache, train_argv, train_env

from dflash_cache import create_cache, open_cache, verify_cache
from dflash_cache import store as store_mod
from dflash_cache.cli import main as cli_main
from dflash_cache.errors import SpecMismatchError
from dflash_cache.synthetic import make_synthetic_cache

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.tokens_per_batch=512",
        "train.num_anchors=16", "metrics.tensorboard=false", "train.max_steps=2", "checkpoint.every_steps=100000"]
# (later --set values win: the full-disk test turns TensorBoard on and checkpoints every 2 steps)


def _cache(tmp_path: Path, name: str = "cache") -> Path:
    return Path(small_cache(str(tmp_path / name), n_samples=32, samples_per_part=6))


def _one_line_error(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr[-3000:]
    return last


def test_held_out_evaluation_skips_corrupt_parts_too(tmp_path):
    """loader.on_corrupt=skip applies to the periodic held-out evaluation's index as to the loader's."""
    url = _cache(tmp_path)
    parts = open_cache(str(url)).parts()
    (url / parts[0].key / "commit.json").write_text("{ not json")  # a bad commit record
    (url / parts[1].data_key / "input_ids" / "c" / "0").write_bytes(b"garbled")  # garbled token array
    sets = ["loader.holdout_fraction=0.3", "eval.every_steps=1", "eval.live_prompts=0"]
    _one_line_error(run_train(BASE, str(url), tmp_path / "run", *sets, expect=2))
    proc = run_train(BASE, str(url), tmp_path / "run-skip", *sets, "loader.on_corrupt=skip")
    assert f"quarantined part {parts[0].key}" in proc.stderr and f"quarantined part {parts[1].key}" in proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "run-skip" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/acceptance_length" in r for r in rows)


def test_a_stray_file_in_a_bucket_directory_is_listed_and_ignored(tmp_path, capsys):
    url = _cache(tmp_path)
    (url / "buckets" / "0" / "notes.txt").write_text("not a part")
    assert cli_main(["verify", str(url)]) == 0
    assert "1 stray file(s) ignored by readers: buckets/0/notes.txt" in capsys.readouterr().out
    assert verify_cache(str(url)).stray == ["buckets/0/notes.txt"]
    assert cli_main(["gc", str(url)]) == 0 and (url / "buckets" / "0" / "notes.txt").exists()  # not gc's to remove
    run_train(BASE + ["loader.holdout_fraction=0.0"], str(url), tmp_path / "run")


def test_a_missing_bucket_group_document_fails_verify_and_a_rerun_restores_it(tmp_path, capsys):
    url = _cache(tmp_path)
    (url / "buckets" / "1" / "zarr.json").unlink()
    assert cli_main(["verify", str(url)]) == 2
    err = capsys.readouterr().err
    assert "buckets/1/zarr.json: missing" in err and "Traceback" not in err
    cache = open_cache(str(url))
    create_cache(str(url), cache.spec, chunk_tokens=cache.chunk_tokens, shard_tokens=cache.shard_tokens)
    assert verify_cache(str(url)).ok


def test_two_jobs_creating_one_cache_at_the_same_instant_one_is_refused(tmp_path, monkeypatch):
    url = str(tmp_path / "c")
    make_synthetic_cache(str(tmp_path / "a"), 4, seed=1)
    make_synthetic_cache(str(tmp_path / "b"), 4, seed=1, hidden_size=32)
    spec_a, spec_b = open_cache(str(tmp_path / "a")).spec, open_cache(str(tmp_path / "b")).spec
    assert spec_a.fingerprint != spec_b.fingerprint
    real = store_mod._root_attrs
    calls = {"n": 0}

    def racing(storage):  # job B checked "no cache yet" just before job A created it
        calls["n"] += 1
        if calls["n"] == 1:
            create_cache(url, spec_a)
            return None
        return real(storage)

    Path(url).mkdir()  # (an empty directory: both jobs look for a cache in it)
    monkeypatch.setattr(store_mod, "_root_attrs", racing)
    with pytest.raises(SpecMismatchError, match="created by another job at the same moment"):
        create_cache(url, spec_b)
    monkeypatch.setattr(store_mod, "_root_attrs", real)
    assert open_cache(url).spec.fingerprint == spec_a.fingerprint
    calls["n"] = 0
    monkeypatch.setattr(store_mod, "_root_attrs", racing)  # the same job twice: both go on with the one cache
    assert create_cache(url, spec_a).spec.fingerprint == spec_a.fingerprint


def test_a_commit_record_of_another_cache_fingerprint_is_refused_by_reader_and_verify(tmp_path, capsys):
    url = _cache(tmp_path)
    part = open_cache(str(url)).parts()[0]
    rec_path = url / part.key / "commit.json"
    rec = json.loads(rec_path.read_text())
    rec["cache_fingerprint"] = "0123456789abcdef"
    rec_path.write_text(json.dumps(rec))
    parts, bad = open_cache(str(url)).scan_parts()
    assert part.key not in [p.key for p in parts] and bad[0].part == part.key
    assert cli_main(["verify", str(url)]) == 2
    assert "written for cache fingerprint 0123456789abcdef" in capsys.readouterr().err
    _one_line_error(run_train(BASE + ["loader.holdout_fraction=0.0"], str(url), tmp_path / "run", expect=2))


@pytest.mark.parametrize(("size", "steps", "every"), [("60k", 6, 2), ("450k", 6, 2), ("600k", 30, 10)])
def test_a_real_full_disk_at_a_checkpoint_with_tensorboard_on_is_one_line(tmp_path, size, steps, every):
    """The run dir on a small tmpfs (private mount namespace), TensorBoard writing beside the checkpoints. At
    600k with a save every 10 steps the checkpoint's background write fills the disk and the next steps' metrics
    writes (JSONL and TensorBoard) fail before the next save reports it."""
    url = _cache(tmp_path)
    small = tmp_path / "small"
    small.mkdir()
    argv = train_argv(BASE + ["loader.holdout_fraction=0.0", "metrics.tensorboard=true"], str(url), small / "run",
                      f"train.max_steps={steps}", f"checkpoint.every_steps={every}")
    cmd = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size="$0" tmpfs "$1" && shift && exec "$@"', size,
           str(small), sys.executable, "-m", "train.cli", *argv]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=train_env())
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "No space left on device" in last and str(small / "run") in last


def test_a_failed_checkpoint_write_then_a_failed_metrics_write_leave_no_thread_running(tmp_path, monkeypatch):
    """The background checkpoint write fails (disk full), then the next step's metrics write fails before a save
    reports it: the trainer still closes everything (checkpoint writer, readers) before the error leaves it. A
    reader thread left inside a C++ call when the interpreter exits aborts the process after the one-line
    error (``terminate called without an active exception``, SIGABRT)."""
    import errno
    import threading

    import train.components.checkpoint as ckpt_mod
    from dflash_cache.errors import DFlashError
    from dflash_cache.runtime.config import load_config
    from train.components.metrics import MetricLogger
    from train.components.rundir import write_error
    from train.loop.loop import train

    url = _cache(tmp_path)
    cfg = load_config(CONFIG, BASE + ["loader.holdout_fraction=0.0", "train.max_steps=6", "checkpoint.every_steps=2"])

    def full_disk(root, snap):
        raise OSError(errno.ENOSPC, "No space left on device", str(root))

    real_log = MetricLogger.log

    def log(self, step, values, kind="train"):
        if step == 3:
            raise write_error(self._path, OSError(errno.ENOSPC, "No space left on device"))
        return real_log(self, step, values, kind)

    monkeypatch.setattr(ckpt_mod, "write_checkpoint", full_disk)
    monkeypatch.setattr(MetricLogger, "log", log)
    before = set(threading.enumerate())
    with pytest.raises(DFlashError, match="No space left on device"):
        train(cfg, str(url), tmp_path / "run")
    assert [t.name for t in threading.enumerate() if t not in before and t.is_alive()] == []

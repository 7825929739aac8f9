"""Generation identifiers are never reused for a part: not after ``gc`` removed the part's directory, not
after ``release`` declared its writer dead, not on a rerun. A writer frozen while it held a part, resumed
after the part was removed and written again by another job, removes nothing of the new owner's: every
committed file stays bitwise as committed and ``verify`` passes. Caches written while generations were
plain counters (``g000001``) still read."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_cache_fencing import _LATE_WRITER, _files, _fill, _make

from dflash_cache import open_cache, verify_cache
from dflash_cache.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0
KEY = "buckets/1/frozen"


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    _make(str(tmp_path / "c"))
    return tmp_path / "c"


def _start_late_writer(cache_dir: Path, go: Path) -> tuple[subprocess.Popen, str]:
    """The writer on "host A", SIGSTOPped (a frozen node) once it holds the part and wrote two shards."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_HOST_ID": "host-a", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _LATE_WRITER, str(cache_dir), str(go)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline().split()
    assert first[:1] == ["written"], proc.stderr.read() if proc.poll() is not None else first
    os.kill(proc.pid, signal.SIGSTOP)
    return proc, first[1]


def _gc_until_the_part_is_gone(cache_dir: Path, min_age_s: float | None = None) -> None:
    """``dflash-cache gc`` (or, with ``min_age_s`` below what the command accepts, the same library call)."""
    deadline = time.monotonic() + DEADLINE_S
    while (cache_dir / KEY).exists():
        if min_age_s is None:
            assert cli_main(["gc", str(cache_dir)]) == 0
        else:
            open_cache(str(cache_dir)).gc(min_age_s=min_age_s)
        assert time.monotonic() < deadline, "gc never removed the frozen writer's part"
        if (cache_dir / KEY).exists():
            time.sleep(0.05)  # (a poll interval: the frozen writer's heartbeat ages past min_age_s)


def _rewrite_then_resume(cache_dir: Path, proc: subprocess.Popen, go: Path, late_dir: str) -> tuple[dict, str]:
    """A new job writes the part again (lease numbers start again: the directory was removed), then the
    frozen writer resumes and finishes. Returns the committed files and the late writer's stderr."""
    cache = open_cache(str(cache_dir))
    with cache.part_writer(1, "frozen", meta={"unit": 9}) as w:
        _fill(w, 5000, 3)
    number = re.compile(r"/g(\d{6})")
    assert number.search(w.data_key)[1] == number.search(late_dir)[1]  # the same lease number as the frozen one's
    committed = _files(cache_dir, KEY)
    go.touch()
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=DEADLINE_S)
    assert _files(cache_dir, KEY) == committed, err  # bitwise: nothing of the new owner's part changed
    assert w.data_key != late_dir  # ... but another generation
    return committed, err


def _assert_untouched(cache_dir: Path, committed: dict, proc: subprocess.Popen, err: str) -> None:
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"error: part {KEY} was taken over by another process" in err and "dropped" in err
    assert _files(cache_dir, KEY) == committed  # bitwise: nothing of the new owner's part changed
    report = verify_cache(str(cache_dir))
    assert report.ok and report.n_samples == 15 and not report.garbage
    assert cli_main(["verify", str(cache_dir)]) == 0
    got = open_cache(str(cache_dir)).read_samples([5000, 5001, 5002])
    g = torch.Generator().manual_seed(5000)
    from dflash_cache.synthetic import synthetic_features

    assert all(torch.equal(s.features, synthetic_features(70, 3, 64, g)) for s in got)


def _cleanup(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_freeze_timeout_gc_rerun_resume_leaves_the_new_owners_part_untouched(cache_dir, tmp_path):
    go = tmp_path / "go"
    proc, late_dir = _start_late_writer(cache_dir, go)
    try:
        frozen_at = time.time()
        _gc_until_the_part_is_gone(cache_dir, min_age_s=0.5)  # its lease times out; gc removes the part
        committed, err = _rewrite_then_resume(cache_dir, proc, go, late_dir)
        frozen_s = time.time() - frozen_at
    finally:
        _cleanup(proc)
    _assert_untouched(cache_dir, committed, proc, err)
    # the real figures: how old its heartbeat was (not a fixed 600 s), and its own timeout
    age = int(re.search(r"this process's last lease heartbeat was (\d+) s ago", err)[1])
    assert 0 <= age <= frozen_s + 5 and "every 30 s" in err and "(600 s in this process)" in err, err


def test_release_gc_rerun_resume_leaves_the_new_owners_part_untouched(cache_dir, tmp_path, capsys):
    go = tmp_path / "go"
    proc, late_dir = _start_late_writer(cache_dir, go)
    try:
        assert cli_main(["release", str(cache_dir), "--host", "host-a", "--force"]) == 0
        assert KEY in capsys.readouterr().out
        _gc_until_the_part_is_gone(cache_dir)  # the default --min-age: the release alone makes it gone
        committed, err = _rewrite_then_resume(cache_dir, proc, go, late_dir)
    finally:
        _cleanup(proc)
    _assert_untouched(cache_dir, committed, proc, err)
    assert re.search(r"`dflash-cache release --host host-a` declared this host's leases dead \d+ s ago", err), err


def test_a_part_written_with_a_counter_generation_still_reads(cache_dir, capsys):
    """A part as written before generations carried their writer's token: directory ``g000001``, a record
    of format 2 without ``writer``."""
    cache = open_cache(str(cache_dir))
    with cache.part_writer(1, "old", meta={"unit": 4}) as w:
        _fill(w, 8000, 3)
    part = cache_dir / "buckets/1/old"
    (part / w.generation.dir).rename(part / "g000001")
    (part / f"{w.generation.dir}.seal").rename(part / "g000001.seal")
    rec = json.loads((part / "commit.json").read_text())
    assert rec.pop("writer") == w.generation.token and rec["generation"] == 1
    rec["format_version"] = 2
    (part / "commit.json").write_text(json.dumps(rec, indent=1))
    before = _files(cache_dir, "buckets/1/old")
    report = verify_cache(str(cache_dir))
    assert report.ok and report.n_samples == 15 and not report.garbage and not report.unknown
    again = open_cache(str(cache_dir))
    info = next(p for p in again.parts() if p.name == "old")
    assert info.data_key == "buckets/1/old/g000001" and info.writer == ""
    assert [s.sample_id for s in again.read_samples([8000, 8001, 8002])] == [8000, 8001, 8002]
    assert again.lost_generations() == []
    assert cli_main(["gc", str(cache_dir)]) == 0 and "removed 0" in capsys.readouterr().out
    assert _files(cache_dir, "buckets/1/old") == before


def test_new_generations_are_unique_per_writer_and_numbered_above_what_is_left(cache_dir):
    """A lease taken while an older generation's directory is left (a late writer's, whose lease file is
    gone) is numbered above it; every generation carries its own writer's token."""
    cache = open_cache(str(cache_dir))
    left = cache_dir / "buckets/1/p" / "g000004-00000000deadbeef"
    (left / "features").mkdir(parents=True)  # a late writer's files, recreated after gc removed the part
    w = cache.part_writer(1, "p")
    assert w.generation.number == 5 and re.fullmatch(r"[0-9a-f]{16}", w.generation.token)
    assert not left.exists()  # an older generation: the holder clears it (sealed dead first)
    w.abort()
    w2 = cache.part_writer(1, "p")
    assert w2.generation.token != w.generation.token
    w2.abort()


def test_a_late_writer_whose_part_was_committed_meanwhile_says_taken_over(cache_dir, monkeypatch):
    """A writer that took the lease, then stalled before it opened the part, while another process took the
    part over and committed it: "taken over" (one line), not "already committed"."""
    from dflash_cache import lease as lease_mod
    from dflash_cache.lease import LeaseLostError, acquire

    cache = open_cache(str(cache_dir))
    stalled = acquire(cache.storage, "buckets/1/late")
    lease_mod._keeper.drop(stalled)  # its lease looks dead from here on
    with cache.part_writer(1, "late") as w:
        _fill(w, 9000, 3)
    committed = _files(cache_dir, "buckets/1/late")
    with pytest.raises(LeaseLostError, match="was taken over by another process while this one wrote it"):
        cache.part_writer(1, "late", lease=stalled)
    assert _files(cache_dir, "buckets/1/late") == committed and verify_cache(str(cache_dir)).ok


def test_timeouts_below_three_heartbeats_are_refused(cache_dir, capsys):
    from dflash_cache.errors import ConfigError
    from dflash_cache.runtime.config import load_config

    assert cli_main(["gc", str(cache_dir), "--min-age", "40"]) == 2
    err = capsys.readouterr().err
    assert "--min-age 40 is below 90 s" in err and "every 30 s" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["gc", str(cache_dir), "--min-age", "90"]) == 0
    with pytest.raises(ConfigError, match=r"extract\.lease_timeout_s.*below 90 s"):
        load_config(ROOT / "configs" / "tiny.toml", ["extract.lease_timeout_s=40"])
    assert load_config(ROOT / "configs" / "tiny.toml", ["extract.lease_timeout_s=90"]).extract.lease_timeout_s == 90


def test_a_late_writer_resuming_while_the_new_holder_holds_the_same_lease_number_changes_nothing(cache_dir, tmp_path):
    """Freeze -> timeout -> gc -> a rerun takes the part with the same lease number and is still writing it ->
    the frozen writer resumes mid-write and tries to commit. The lease files carry equal numbers, so only the
    token tells the two holders apart: the late writer stops ("taken over", exit 2) and nothing of the new
    holder's changes (its generation bitwise, its lease file its own); the new holder then commits."""
    from dflash_cache.lease import newest

    go = tmp_path / "go"
    proc, late_dir = _start_late_writer(cache_dir, go)
    try:
        _gc_until_the_part_is_gone(cache_dir, min_age_s=0.5)
        w = open_cache(str(cache_dir)).part_writer(1, "frozen", meta={"unit": 9})
        _fill(w, 5000, 2)  # mid-write: two shards on storage, no commit
        number = re.compile(r"/g(\d{6})")
        assert number.search(w.data_key)[1] == number.search(late_dir)[1] and w.data_key != late_dir
        mine = _files(cache_dir, w.data_key)
        assert mine and newest(w.cache.storage, KEY)[0] == w.generation.number
        go.touch()
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        _cleanup(proc)
    assert proc.returncode == 2, err
    assert f"error: part {KEY} was taken over by another process" in err and "Traceback" not in err, err
    assert _files(cache_dir, w.data_key) == mine  # bitwise: the new holder's generation
    gen, holder = newest(w.cache.storage, KEY)
    assert (gen, holder.token) == (w.generation.number, w.generation.token) and w._lease.held()
    assert not (cache_dir / KEY / "commit.json").exists()
    _fill(w, 5002, 1)
    w.commit()
    report = verify_cache(str(cache_dir))
    assert report.ok and report.n_samples == 15 and not report.garbage
    got = open_cache(str(cache_dir)).read_samples([5000, 5001, 5002])
    from dflash_cache.synthetic import synthetic_features

    g = torch.Generator().manual_seed(5000)
    want = [synthetic_features(70, 3, 64, g) for _ in range(2)]
    want.append(synthetic_features(70, 3, 64, torch.Generator().manual_seed(5002)))
    assert all(torch.equal(s.features, f) for s, f in zip(got, want, strict=True))

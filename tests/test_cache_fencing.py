"""Fencing: a writer that lost its part (frozen past its lease, then resumed) can write nothing that the
part's new owner or a reader uses; its files are garbage that gc removes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dflash_cache import lease as lease_mod
from dflash_cache import open_cache, verify_cache
from dflash_cache.cli import main as cli_main
from dflash_cache.lease import LeaseHeldError, LeaseLostError, acquire, newest
from dflash_cache.synthetic import make_synthetic_cache, synthetic_features

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0


def _make(url: str) -> None:
    make_synthetic_cache(url, 12, lengths=[40 + i for i in range(12)], samples_per_part=6,
                         bucket_edges=(64, 128), chunk_tokens=16, shard_tokens=64, seed=3)


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    _make(str(tmp_path / "c"))
    return tmp_path / "c"


def _fill(w, first_id: int, n: int = 3, t: int = 70) -> None:
    g = torch.Generator().manual_seed(first_id)
    for i in range(n):
        w.add(first_id + i, torch.arange(t), torch.ones(t, dtype=torch.bool), synthetic_features(t, 3, 64, g))


# The late writer, on "host A": writes two shards of part buckets/1/frozen, reports, waits for `go`, then
# writes more and commits -- through the console scripts' error handling (one line, exit code).
_LATE_WRITER = textwrap.dedent("""
    import pathlib, sys, time
    import torch
    from dflash_cache import open_cache
    from dflash_cache.runtime.entry import run_cli
    from dflash_cache.synthetic import synthetic_features

    def fill(w, first, n):
        g = torch.Generator().manual_seed(first)
        for i in range(n):
            w.add(first + i, torch.arange(70), torch.ones(70, dtype=torch.bool), synthetic_features(70, 3, 64, g))

    def main(argv):
        cache = open_cache(sys.argv[1])
        w = cache.part_writer(1, "frozen", meta={"unit": 9})
        fill(w, 5000, 2)  # 140 tokens: two whole 64-token shards are on storage now
        print("written", w.data_key, flush=True)
        go = pathlib.Path(sys.argv[2])
        while not go.exists():
            time.sleep(0.05)
        fill(w, 6000, 3)  # more shards, into its own generation's directory
        w.commit()
        print("committed", flush=True)

    sys.exit(run_cli(main, []))
""")


def _files(root: Path, key: str) -> dict[str, bytes]:
    base = root / key
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


def test_a_frozen_writer_on_another_host_cannot_touch_the_part_committed_meanwhile(cache_dir, tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_HOST_ID": "host-a", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _LATE_WRITER, str(cache_dir), str(go)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().split()
        assert first[:1] == ["written"], proc.stderr.read() if proc.poll() is not None else first
        late_dir = first[1]
        os.kill(proc.pid, signal.SIGSTOP)  # a stalled node: no heartbeat from here on
        cache = open_cache(str(cache_dir))
        key = "buckets/1/frozen"
        with pytest.raises(LeaseHeldError, match="host"):  # its heartbeat is fresh: it still holds the part
            acquire(cache.storage, key, timeout_s=60.0)
        # this process is "host B": with a 0.5 s lease timeout the stopped writer's lease turns stale
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                lease = acquire(cache.storage, key, timeout_s=0.5)
                break
            except LeaseHeldError:
                assert time.monotonic() < deadline, "the stopped writer's lease never turned stale"
                time.sleep(0.05)
        with cache.part_writer(1, "frozen", meta={"unit": 9}, lease=lease) as w:
            _fill(w, 5000, 3)
        assert w.data_key != late_dir and not (cache_dir / late_dir).exists()  # fenced off at takeover
        committed = _files(cache_dir, key)
        reference = [s.features.clone() for s in open_cache(str(cache_dir)).read_samples([5000, 5001, 5002])]

        go.touch()
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "error: part buckets/1/frozen was taken over by another process" in err and "dropped" in err
    assert _files(cache_dir, key) == committed  # bitwise: nothing of the committed part changed
    again = open_cache(str(cache_dir)).read_samples([5000, 5001, 5002])
    assert all(torch.equal(a.features, b) for a, b in zip(again, reference, strict=True))
    report = verify_cache(str(cache_dir))
    assert report.ok and report.n_samples == 15 and not report.garbage
    assert cli_main(["verify", str(cache_dir)]) == 0


def test_late_writers_files_in_a_committed_part_are_never_read_and_gc_removes_them(cache_dir, capsys):
    cache = open_cache(str(cache_dir))
    w = cache.part_writer(1, "late")
    _fill(w, 2000)
    lease_mod._keeper.drop(w._lease)  # this process plays both sides: the writer's lease looks dead
    taker = cache.part_writer(1, "late")
    _fill(taker, 3000)
    taker.commit()
    _fill(w, 2100)  # the late writer keeps writing: into its own generation only
    assert (cache_dir / w.data_key / "features").is_dir()
    committed = _files(cache_dir, taker.data_key)
    report = verify_cache(str(cache_dir))
    assert report.ok and report.garbage == [w.data_key]
    assert "file(s) of writers that lost their part" in report.summary()
    with pytest.raises(LeaseLostError, match="taken over"):
        w.commit()
    assert _files(cache_dir, taker.data_key) == committed
    assert open_cache(str(cache_dir)).read_samples([3000])[0].sample_id == 3000
    # a late writer killed before it noticed leaves its files: gc removes them, never the committed ones
    (cache_dir / w.data_key / "features").mkdir(parents=True)
    (cache_dir / w.data_key / "features" / "zarr.json").write_text("{}")
    assert cli_main(["gc", str(cache_dir)]) == 0
    assert w.data_key in capsys.readouterr().out
    assert not (cache_dir / w.data_key).exists() and _files(cache_dir, taker.data_key) == committed
    assert verify_cache(str(cache_dir)).ok


@pytest.mark.parametrize("url_kind", ["local", "memory"])
def test_a_remover_and_a_committing_writer_never_both_win(tmp_path, monkeypatch, url_kind):
    """The seal decides between a writer committing generation g and a new owner removing it, on local
    disk and on an fsspec store alike."""
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = str(tmp_path / "c") if url_kind == "local" else f"memory://fence-{tmp_path.name}/c"
    _make(url)
    cache = open_cache(url)
    w = cache.part_writer(1, "race")
    _fill(w, 4000)
    lease_mod._keeper.drop(w._lease)
    taker = cache.part_writer(1, "race")  # seals w's generation dead and removes its files
    assert cache.storage.get(f"buckets/1/race/{w.generation.dir}.seal") == b"dead"
    with pytest.raises(LeaseLostError, match="taken over"):
        w.commit()  # its seal fails first: it never creates the commit record
    _fill(taker, 4100)
    info = taker.commit()
    assert info.generation == taker._lease.gen and info.data_key == taker.data_key
    rep = verify_cache(url)
    assert rep.ok and rep.n_samples == 15 and not rep.garbage
    assert newest(cache.storage, "buckets/1/race") == (0, None)

"""Jobs whose settings change what a part holds cannot share one ``--out``: every such setting is part
of the cache's fingerprint, and a job that differs is refused (exit 2, naming the differing keys)
before it writes a byte -- whether it starts after the other job, before it, or at the same moment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash_cache import CacheSpec, TeacherInfo, create_cache, open_cache, verify_cache
from dflash_cache.errors import SpecMismatchError
from dflash_cache.storage import LocalStorage
from extract.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).with_name("dflash-extract"))
N = 24


def _args(teacher: Path, out: Path, *sets: str) -> list[str]:
    base = ["configs/tiny.toml", "--out", str(out), "--no-progress", "--set", f"teacher.path={teacher}",
            "--set", f"data.path=builtin:tiny-chat?n={N}", "--set", "extract.tokens_per_batch=1024"]
    for s in sets:
        base += ["--set", s]
    return base


def _main(args: list[str]) -> int:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main(args)
    finally:
        os.chdir(cwd)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


SETTINGS = {  # (first job, second job): one setting that changes the stored samples
    "extract.unit_size": ("extract.unit_size=4", "extract.unit_size=8"),
    "data.min_loss_tokens": ("data.min_loss_tokens=2", "data.min_loss_tokens=40"),
}


@pytest.mark.parametrize("key", sorted(SETTINGS))
@pytest.mark.parametrize("order", ["a_first", "b_first"])
def test_a_second_job_with_other_settings_is_refused_before_it_writes(tiny_teacher_dir, tmp_path, capsys, key,
                                                                      order):
    a, b = SETTINGS[key] if order == "a_first" else SETTINGS[key][::-1]
    out = tmp_path / "cache"
    assert _main(_args(tiny_teacher_dir, out, a)) == 0
    before = _files(out)
    capsys.readouterr()
    assert _main(_args(tiny_teacher_dir, out, b)) == 2
    err = capsys.readouterr().err
    assert f"content_settings.{key}" in err and "was written with another spec" in err, err
    assert _files(out) == before  # not one byte written, not one removed
    assert verify_cache(str(out)).ok
    # the first job's own settings still resume (nothing to do)
    assert _main(_args(tiny_teacher_dir, out, a)) == 0


def _spec(min_loss: int) -> CacheSpec:
    teacher = TeacherInfo("t", None, 4, 8, 32)
    return CacheSpec(teacher, (1, 2), "tok", 64, bucket_edges=(16,),
                     content_settings={"data.min_loss_tokens": min_loss, "extract.unit_size": 4})


class _RacingStorage(LocalStorage):
    """Holds every create-if-absent of the root until both creators have reached it: a true
    simultaneous start, where each saw no cache when it looked."""

    def __init__(self, url: str, barrier: threading.Barrier):
        super().__init__(url)
        self.barrier = barrier

    def create_exclusive(self, key: str, data: bytes, durable: bool = False) -> bool:
        if key == "zarr.json":
            self.barrier.wait(timeout=60)
        return super().create_exclusive(key, data, durable)


def test_simultaneous_creators_with_other_settings_exactly_one_wins(tmp_path):
    url = str(tmp_path / "cache")
    barrier = threading.Barrier(2)
    results: dict[int, object] = {}

    def create(min_loss: int) -> None:
        try:
            results[min_loss] = create_cache(url, _spec(min_loss), chunk_tokens=8, shard_tokens=64,
                                             storage=_RacingStorage(url, barrier))
        except SpecMismatchError as err:
            results[min_loss] = err

    threads = [threading.Thread(target=create, args=(m,)) for m in (2, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    errors = [r for r in results.values() if isinstance(r, SpecMismatchError)]
    assert len(results) == 2 and len(errors) == 1, results
    assert errors[0].fields == ["content_settings.data.min_loss_tokens"]
    winner = next(m for m, r in results.items() if not isinstance(r, SpecMismatchError))
    assert open_cache(url).spec == _spec(winner)


def _start(teacher: Path, out: Path, setting: str) -> subprocess.Popen:
    return subprocess.Popen([EXE, *_args(teacher, out, setting)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_two_jobs_started_together_with_other_settings_never_mix(tiny_teacher_dir, tmp_path):
    """Through the real command: one job finishes the whole dataset, the other exits 2 naming the key,
    and the cache is exactly what the winner alone writes."""
    out = tmp_path / "cache"
    settings = SETTINGS["extract.unit_size"]
    procs = [_start(tiny_teacher_dir, out, s) for s in settings]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], outputs
    loser = codes.index(2)
    assert "content_settings.extract.unit_size" in outputs[loser], outputs[loser]
    winner = settings[codes.index(0)]
    ref = tmp_path / "reference"
    assert _main(_args(tiny_teacher_dir, ref, winner)) == 0
    got, want = open_cache(str(out)), open_cache(str(ref))
    assert got.spec == want.spec
    ids = sorted(got.index().sample_ids.tolist())
    assert ids == sorted(want.index().sample_ids.tolist())
    for s, r in zip(got.read_samples(ids), want.read_samples(ids), strict=True):
        assert s.input_ids.equal(r.input_ids) and s.loss_mask.equal(r.loss_mask) and s.features.equal(r.features)
    assert verify_cache(str(out)).ok

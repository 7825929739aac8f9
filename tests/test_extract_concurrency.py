"""Several ``dflash-extract`` jobs on one ``--out`` (a requeued job beside the old one) through the real
command: every job that exits 0 counts exactly the samples of a single run, and the cache holds each
sample once, bitwise as a single process writes it -- also when one job is SIGKILLed inside a part
commit."""

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

from dflash_cache import open_cache, verify_cache
from extract.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).with_name("dflash-extract"))
N, UNIT = 48, 4  # 12 work units: enough for the jobs to interleave


def _cmd(teacher: Path, out: Path) -> list[str]:
    return [EXE, "configs/tiny.toml", "--out", str(out), "--no-progress", "--set", f"teacher.path={teacher}",
            "--set", f"data.path=builtin:tiny-chat?n={N}", "--set", f"extract.unit_size={UNIT}",
            "--set", "extract.tokens_per_batch=1024"]


def _main(teacher: Path, out: Path) -> int:
    """The same command in this process (a plain run or rerun)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main(_cmd(teacher, out)[1:])
    finally:
        os.chdir(cwd)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_CACHE_FSYNC": "1"}


def _start(teacher: Path, out: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(_cmd(teacher, out), cwd=ROOT, env={**_env(), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _claimed(output: str) -> int | None:
    m = re.search(r"cache: (\d+) samples in (\d+) complete units", output)
    return int(m.group(1)) if m else None


def _snapshot(url: Path) -> tuple[list[int], dict[int, bytes]]:
    cache = open_cache(str(url))
    ids = cache.index().sample_ids.tolist()
    samples = cache.read_samples(sorted(set(ids)))
    return ids, {s.sample_id: s.input_ids.numpy().tobytes() + s.loss_mask.numpy().tobytes()
                 + s.features.view(torch.int16).numpy().tobytes() for s in samples}


@pytest.fixture(scope="module")
def reference(tiny_teacher_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "cache"
    assert _main(tiny_teacher_dir, out) == 0
    ids, snap = _snapshot(out)
    assert sorted(ids) == list(range(N))
    return snap


def _assert_same_as_single_run(out: Path, reference: dict[int, bytes]) -> None:
    ids, snap = _snapshot(out)
    assert sorted(ids) == sorted(reference), "samples lost or written twice"
    assert snap == reference  # ids, masks and features bitwise
    assert verify_cache(str(out)).ok and open_cache(str(out)).uncommitted() == []


@pytest.mark.parametrize("n_jobs", [2, 3])
def test_concurrent_jobs_end_with_exactly_the_single_run_samples(tiny_teacher_dir, reference, tmp_path, n_jobs):
    overlapped = []
    for attempt in range(3):  # a loaded machine can start one job after the other finished: then try again
        out = tmp_path / f"cache{attempt}"
        procs = [_start(tiny_teacher_dir, out) for _ in range(n_jobs)]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * n_jobs, outputs
        assert [_claimed(o) for o in outputs] == [N] * n_jobs  # every job counts the whole, re-checked dataset
        _assert_same_as_single_run(out, reference)
        by_others = [int(re.search(r"(\d+) completed by another process", o).group(1)) for o in outputs]
        overlapped.append(sum(by_others) > 0)
        if overlapped[-1]:
            break
    assert overlapped[-1], "the jobs never overlapped: the test proves nothing"


def _kill_in_commit(victim: subprocess.Popen, out: Path) -> str:
    """SIGKILL ``victim`` while one of its parts has small arrays but no commit record; returns where the
    kill landed, read from the part after the process is gone."""
    deadline = time.time() + 600
    while time.time() < deadline and victim.poll() is None:
        for d in out.glob("buckets/*/u*"):
            if not any(d.glob("g*/input_ids/zarr.json")) or (d / "commit.json").exists():  # (data: g<gen>/)
                continue
            leases = sorted(d.glob("lease.*.json"))
            try:
                pid = json.loads(leases[-1].read_text())["pid"] if leases else None
            except (OSError, ValueError):
                continue
            if pid == victim.pid:
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                state = "after" if (d / "commit.json").exists() else "inside"
                return f"{state} the commit of {d.relative_to(out)}"
        time.sleep(0.002)
    return "missed"


def test_a_job_killed_inside_a_part_commit_loses_nothing(tiny_teacher_dir, reference, tmp_path, capsys):
    landed = []
    for _ in range(3):  # retry the (rare) trial where the kill came late
        out = tmp_path / f"cache{len(landed)}"
        # the victim pauses 1 s inside each commit (data written, no commit record), so that a poller starved
        # by a loaded machine still lands its kill there
        victim = _start(tiny_teacher_dir, out, DFLASH_TEST_COMMIT_DELAY_S="1.0")
        other = _start(tiny_teacher_dir, out)
        landed.append(_kill_in_commit(victim, out))
        output = other.communicate(timeout=300)[0]
        victim.communicate()
        if landed[-1].startswith("inside"):
            break
    assert landed[-1].startswith("inside the commit of"), landed
    # the surviving job took the dead job's parts over and finished everything
    assert other.returncode == 0 and _claimed(output) == N, output
    capsys.readouterr()
    assert _main(tiny_teacher_dir, out) == 0  # a plain rerun: nothing left to do
    rerun = capsys.readouterr().out
    assert _claimed(rerun) == N and f"units: {N // UNIT} ({N // UNIT} already complete" in rerun
    _assert_same_as_single_run(out, reference)

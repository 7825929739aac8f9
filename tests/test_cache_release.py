"""Fast takeover across hosts: two "nodes" simulated on this machine by giving each job its own host
identity (``DFLASH_HOST_ID``: leases then count as another host's, alive by heartbeat only). Node A is
SIGKILLed while it holds parts; node B waits for them (the lease timeout is 600 s) until
``dflash-cache release CACHE --host node-a`` -- refused while A's heartbeat is fresh, accepted with
``--force`` -- after which B takes A's parts over within one heartbeat interval and the cache equals
a single-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from dflash_cache import open_cache, verify_cache
from dflash_cache.cli import main as cache_main
from dflash_cache.lease import HEARTBEAT_S, LEASE_TIMEOUT_S
from extract.cli import main as extract_main

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).with_name("dflash-extract"))
N, UNIT = 32, 4


def _args(teacher: Path, out: Path) -> list[str]:
    return ["configs/tiny.toml", "--out", str(out), "--no-progress", "--set", f"teacher.path={teacher}",
            "--set", f"data.path=builtin:tiny-chat?n={N}", "--set", f"extract.unit_size={UNIT}",
            "--set", "extract.tokens_per_batch=1024"]


def _start(teacher: Path, out: Path, host: str) -> tuple[subprocess.Popen, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HOST_ID": host}
    proc = subprocess.Popen([EXE, *_args(teacher, out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    return proc, lines


def _wait(cond, what: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _held_by(out: Path, host: str) -> list[Path]:
    held = []
    for d in out.glob("buckets/*/u*"):
        if (d / "commit.json").exists():
            continue
        for f in d.glob("lease.*.json"):
            try:
                if json.loads(f.read_text())["host"] == host:
                    held.append(d)
            except (OSError, ValueError, KeyError):
                pass
    return held


def _snapshot(url: Path) -> dict[int, bytes]:
    cache = open_cache(str(url))
    ids = sorted(cache.index().sample_ids.tolist())
    assert len(ids) == len(set(ids))
    return {s.sample_id: s.input_ids.numpy().tobytes() + s.loss_mask.numpy().tobytes()
            + s.features.view(torch.int16).numpy().tobytes() for s in cache.read_samples(ids)}


def test_release_of_a_killed_node_lets_the_survivor_finish_at_once(tiny_teacher_dir, tmp_path, capsys):
    out = tmp_path / "cache"
    a, _ = _start(tiny_teacher_dir, out, "node-a")
    _wait(lambda: _held_by(out, "node-a"), "node A to hold a part")
    a.kill()
    a.wait()
    orphaned = _held_by(out, "node-a")
    assert orphaned, "node A died without a leased part: the test proves nothing"

    b, b_lines = _start(tiny_teacher_dir, out, "node-b")
    _wait(lambda: any("being written by other processes" in ln for ln in b_lines), "node B to wait for A's parts")
    assert b.poll() is None  # B waits: A's leases are live by heartbeat for LEASE_TIMEOUT_S
    assert LEASE_TIMEOUT_S > 60

    # A's heartbeat is seconds old: refused without --force
    assert cache_main(["release", str(out), "--host", "node-a"]) == 2
    err = capsys.readouterr().err
    assert "host node-a wrote a lease heartbeat" in err and "--force" in err, err
    assert b.poll() is None

    t_release = time.time()
    assert cache_main(["release", str(out), "--host", "node-a", "--force"]) == 0
    said = capsys.readouterr().out
    assert "declared the leases of host node-a dead" in said and str(orphaned[0].relative_to(out)) in said
    b.wait(timeout=240)
    took = time.time() - t_release
    print(f"node B finished {took:.1f} s after the release")
    output = "".join(b_lines)
    assert b.returncode == 0, output
    assert took < HEARTBEAT_S, f"node B needed {took:.1f} s after the release"
    assert "took over part" in output or "completed by another process" in output

    ref = tmp_path / "single"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert extract_main(_args(tiny_teacher_dir, ref)) == 0
    finally:
        os.chdir(cwd)
    assert _snapshot(out) == _snapshot(ref)
    assert verify_cache(str(out)).ok


def test_release_of_a_host_without_leases_is_recorded_and_harmless(tmp_path, capsys):
    from dflash_cache.synthetic import make_synthetic_cache

    url = str(tmp_path / "cache")
    make_synthetic_cache(url, n_samples=8)
    assert cache_main(["release", url, "--host", "gone-host"]) == 0
    assert "0 part(s)" in capsys.readouterr().out
    assert verify_cache(url).ok

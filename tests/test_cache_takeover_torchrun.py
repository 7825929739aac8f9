"""Two extraction "nodes" under ``torchrun --nnodes 2`` (c10d rendezvous on 127.0.0.1, one process per node,
each node with its own host identity ``DFLASH_HOST_ID``) write one cache; node B's whole process group (its
elastic agent and worker) is SIGKILLed while B holds a part. Node A's job cannot finish as a job (its last
collective has no peer), so the survivor is a rerun on node A's host identity: it waits for B's parts until
``dflash-cache release CACHE --host node-b`` and then finishes within one heartbeat interval; without the
release it waits for the lease timeout (set short here). The cache then equals a single-process run."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_cache_release import _args, _held_by, _snapshot, _wait

from dflash_cache import verify_cache
from dflash_cache.cli import main as cache_main
from dflash_cache.lease import HEARTBEAT_S
from extract.cli import main as extract_main

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHORT_LEASE_S = 90.0  # the shortest accepted (3 heartbeats): the no-release case waits this long, not 600 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv: list[str], host: str) -> tuple[subprocess.Popen, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_HOST_ID": host}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: agent and worker die together
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    return proc, lines


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node: its torchrun agent and every process under it, at once (a node that dies)."""
    for pid in _tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _node(teacher: Path, out: Path, host: str, port: int) -> tuple[subprocess.Popen, list[str]]:
    torchrun = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "takeover", "--local-addr", "127.0.0.1",
                "--max-restarts", "0", "--no-python", str(BIN / "dflash-extract")]
    return _launch([*torchrun, *_args(teacher, out)], host)


@pytest.fixture(scope="module")
def single(tiny_teacher_dir, tmp_path_factory) -> dict[int, bytes]:
    ref = tmp_path_factory.mktemp("single") / "cache"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert extract_main(_args(tiny_teacher_dir, ref)) == 0
    finally:
        os.chdir(cwd)
    return _snapshot(ref)


@pytest.mark.parametrize("release", [True, False], ids=["release", "lease-timeout"])
def test_a_killed_torchrun_node_is_taken_over_by_a_rerun_on_the_surviving_host(tiny_teacher_dir, tmp_path, single,
                                                                               release, capsys):
    out, port = tmp_path / "cache", _free_port()
    a, a_lines = _node(tiny_teacher_dir, out, "node-a", port)
    b, b_lines = _node(tiny_teacher_dir, out, "node-b", port)
    try:
        _wait(lambda: _held_by(out, "node-b") or b.poll() is not None, "node B to hold a part", timeout=300)
        assert b.poll() is None, "node B ended before it held a part: " + "".join(b_lines)[-3000:]
        assert any("world size 2" in ln for ln in b_lines + a_lines), "".join(a_lines)[-3000:]
        _kill_node(b)
        t_kill = time.time()
        orphaned = _held_by(out, "node-b")
        assert orphaned, "node B died without a leased part: the test proves nothing"
        a.wait(timeout=300)  # its last collective has no peer: torchrun ends node A's job
    finally:
        for p in (a, b):
            if p.poll() is None:
                _kill_node(p)
    a_output = "".join(a_lines)
    print(f"node A's torchrun exited {a.returncode} {time.time() - t_kill:.1f} s after node B's SIGKILL")

    sets = [] if release else ["--set", f"extract.lease_timeout_s={SHORT_LEASE_S}"]
    rerun, lines = _launch([str(BIN / "dflash-extract"), *_args(tiny_teacher_dir, out), *sets], "node-a")
    try:
        _wait(lambda: any("being written by other processes" in ln for ln in lines) or rerun.poll() is not None,
              "the rerun to wait for node B's parts")
        assert rerun.poll() is None, "the rerun did not wait for node B's parts: " + "".join(lines)[-3000:]
        if release:
            t_release = time.time()
            assert cache_main(["release", str(out), "--host", "node-b", "--force"]) == 0
            assert "declared the leases of host node-b dead" in capsys.readouterr().out
        rerun.wait(timeout=300 if release else SHORT_LEASE_S + 300)
    finally:
        if rerun.poll() is None:
            _kill_node(rerun)
    t_done = time.time()
    output = "".join(lines)
    assert rerun.returncode == 0, output[-3000:]
    assert "took over part" in output, output[-3000:]
    if release:
        print(f"takeover: the rerun finished {t_done - t_release:.1f} s after the release "
              f"({t_done - t_kill:.1f} s after the SIGKILL)")
        assert t_done - t_release < HEARTBEAT_S, f"the rerun needed {t_done - t_release:.1f} s after the release"
    else:
        print(f"takeover: the rerun finished {t_done - t_kill:.1f} s after the SIGKILL "
              f"(extract.lease_timeout_s = {SHORT_LEASE_S:.0f})")
        # B's last heartbeat was at most one interval before the kill: the lease times out after that
        assert t_done - t_kill >= SHORT_LEASE_S - HEARTBEAT_S, output[-3000:]
    assert _snapshot(out) == single, a_output[-2000:]
    assert verify_cache(str(out)).ok

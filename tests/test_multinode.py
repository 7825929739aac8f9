"""Multi-node training cannot silently diverge: two "nodes" (two processes started as a launcher starts
them, each with its own node-local run dir) refuse to resume from different steps; a rank that hangs
is named when a collective gives up on it after train.collective_timeout_s."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fixtures.trainer import ROOT, small_cache, train_cmd, train_env

from dflash_cache.runtime.dist import Distributed

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16", "metrics.tensorboard=false"]
DEADLINE_S = 240


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return small_cache(str(tmp_path_factory.mktemp("cache") / "cache"), n_samples=48)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cache: str, runs: list[Path], *overrides: str) -> list[subprocess.Popen]:
    """One process per rank, with the environment torchrun gives each: a 2-node job, one rank per node."""
    port = _port()
    procs = []
    for rank, run in enumerate(runs):
        env = train_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK="0",
                        LOCAL_WORLD_SIZE="1")
        env["WORLD_SIZE"] = "2"
        procs.append(subprocess.Popen(train_cmd(BASE, cache, run, *overrides), cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, err))
    return out


def test_node_local_run_dirs_are_refused_before_the_first_step(cache, tmp_path):
    runs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]  # the same --run-dir, on two nodes' disks
    for (rc, err) in _finish(_launch(cache, runs, "train.max_steps=2", "checkpoint.every_steps=2")):
        assert rc == 0, err[-3000:]
    assert (runs[0] / "checkpoints").is_dir() and not list((runs[1] / "checkpoints").glob("step-*"))
    results = _finish(_launch(cache, runs, "train.max_steps=4", "checkpoint.every_steps=2",
                              "checkpoint.allow_config_change=true"))
    for rc, err in results:
        assert rc == 2, err[-3000:]
        assert "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: the ranks disagree on where to resume (rank 0 on ") and "step 2" in last
        assert "rank 1 on " in last and "step 0" in last and "every node sees" in last
    assert not (runs[0] / "checkpoints" / "step-00000004").exists()  # no step was trained


def test_a_hung_rank_is_named_within_the_collective_timeout(cache, tmp_path):
    runs = [tmp_path / "run", tmp_path / "run"]
    procs = _launch(cache, runs, "train.max_steps=100000", "checkpoint.every_steps=100000",
                    "train.collective_timeout_s=15")
    metrics = tmp_path / "run" / "metrics.jsonl"
    t0 = time.monotonic()
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs if p.poll()]
            assert time.monotonic() - t0 < DEADLINE_S, "training never got going"
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGSTOP)  # rank 1's node hangs
        _, err = procs[0].communicate(timeout=DEADLINE_S)
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        procs[1].kill()
        procs[1].wait()
        if procs[0].poll() is None:
            procs[0].kill()
    assert procs[0].returncode == 2, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 0: a collective waited 15 s (train.collective_timeout_s) for rank 1 on "), last



# A rank's process ends right after RankWatch.close() while its thread is inside a store call (a C++ call that
# releases the GIL; here a 2 s store wait). If that call returns while the interpreter is finalizing, the thread
# is torn down inside C++ and the process aborts (SIGABRT) after a clean run. ``Late.__del__`` runs during
# finalization and keeps it going until the wait has returned (its set waits for the store's one connection).
_EXIT_DURING_STORE_CALL = r"""
import threading, time
from datetime import timedelta
from types import SimpleNamespace
import torch.distributed as dist
from train.components.multinode import RankWatch

store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))  # (port 0: a free one)
inside = threading.Event()

class SlowStore:
    calls = 0
    def set(self, key, value):
        SlowStore.calls += 1
        if SlowStore.calls == 2:  # the thread's first note (the first one is __init__'s, on this thread)
            inside.set()
            try:
                store.wait(["go"], timedelta(seconds=2))
            except Exception:
                pass
        store.set(key, value)

class Late:
    def __del__(self, store=store, sleep=time.sleep):
        store.set("go", "1")
        sleep(0.5)

watch = RankWatch(SimpleNamespace(enabled=True, store=SlowStore(), rank=0, world_size=1), timeout_s=3.0)
assert inside.wait(30), "the rank-alive thread never called the store"
watch.close()
late = Late()
print("closed", flush=True)
"""


def test_a_rank_exiting_while_its_alive_thread_is_in_a_store_call_exits_cleanly():
    proc = subprocess.run([sys.executable, "-c", _EXIT_DURING_STORE_CALL], cwd=ROOT,
                          env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "closed" in proc.stdout


class _Rank(Distributed):
    """A rank of a two-rank job whose process group is not under test: only its rendezvous store is real."""

    @property
    def enabled(self) -> bool:
        return True


def _two_rank_stores() -> tuple[Any, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    port = _port()
    host = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    return host, dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))


def test_ranks_leave_together_and_rank_0_leaves_last():
    """A rank that finished first waits for rank 0's last commit; rank 0, whose process hosts the store, waits
    until the others have left it."""
    from datetime import timedelta

    host, client = _two_rank_stores()
    ranks = [_Rank(rank=0, world_size=2, store=host), _Rank(rank=1, world_size=2, store=client)]
    order: list[int] = []
    threads = [threading.Thread(target=lambda d=d: (d.leave_together(timedelta(seconds=60)), order.append(d.rank)))
               for d in ranks]
    threads[1].start()  # rank 1 finished its last step; rank 0 is still committing
    threads[1].join(0.5)
    assert threads[1].is_alive() and order == []  # it waits for rank 0
    threads[0].start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert order[-1] == 0 and sorted(order) == [0, 1]


def test_a_rank_leaving_without_its_peer_warns_and_returns(caplog):
    from datetime import timedelta

    host, _client = _two_rank_stores()
    t0 = time.monotonic()
    _Rank(rank=0, world_size=2, store=host).leave_together(timedelta(seconds=1))  # rank 1 never comes
    assert time.monotonic() - t0 < 20
    assert "leaving without the other ranks" in caplog.text

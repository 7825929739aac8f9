"""The lock primitives shared by part leases, the run dir's lock and the answer log's lock
(:mod:`dflash_cache.locks`), tested directly: exclusive creation raced by processes released at one
barrier, the staleness rule on this host and across hosts, heartbeats, takeover and release."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_cache import locks
from dflash_cache.locks import (
    Contended,
    FlockFile,
    GenerationLock,
    Heartbeat,
    HolderRecord,
    Keeper,
    heartbeat_advances,
    newest_generation,
    take_generation,
)
from dflash_cache.storage import LocalStorage, make_storage

N_RACERS = 8
ROUNDS = 6


def _wait(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- exclusive creation, raced ---------------------------------------------------------------------------


def _race_create(url: str, me: int, barrier, results) -> None:
    """One racer (a separate process): at each round, wait at the barrier, then create the round's key."""
    st = make_storage(url)
    for r in range(ROUNDS):
        barrier.wait()
        results.put((r, me, st.create_exclusive(f"race/k{r}", f"racer {me}".encode())))


def _race_take(url: str, me: int, barrier, results) -> None:
    """One racer: at the barrier, try to take a generation lock (held until the parent has counted)."""
    st = make_storage(url)
    keeper = Keeper(lambda: 3600.0)
    barrier.wait()
    try:
        lock, _ = take_generation(lambda g: GenerationLock(st, "lock", g, keeper),
                                  lambda: newest_generation(st, "lock", "lock", GenerationLock.parse),
                                  lambda h: h is not None and h.alive(600.0, keeper.holds))
        results.put((me, lock.gen))
    except Contended:
        results.put((me, None))
    barrier.wait()  # everyone has tried: only now may the winner give the lock back


def _run_racers(target, url: str) -> list:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(N_RACERS), ctx.Queue()
    procs = [ctx.Process(target=target, args=(url, i, barrier, results)) for i in range(N_RACERS)]
    for p in procs:
        p.start()
    out = []
    deadline = time.monotonic() + 300
    while len(out) < (ROUNDS * N_RACERS if target is _race_create else N_RACERS):
        assert time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in procs), "a racer failed"
        try:
            out.append(results.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty: look at the racers again
            continue
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    return out


def test_exclusive_create_raced_by_processes_at_one_barrier_has_one_winner(tmp_path):
    url = str(tmp_path / "store")
    out = _run_racers(_race_create, url)
    for r in range(ROUNDS):
        winners = [me for rr, me, won in out if rr == r and won]
        assert len(winners) == 1, f"round {r}: winners {winners}"
        assert (tmp_path / "store" / "race" / f"k{r}").read_bytes() == f"racer {winners[0]}".encode()


def test_a_generation_lock_raced_by_processes_at_one_barrier_has_one_holder(tmp_path):
    out = _run_racers(_race_take, str(tmp_path / "store"))
    assert sorted(g for _, g in out if g is not None) == [1], out


def test_exclusive_create_on_fsspec_raced_by_threads_at_one_barrier():
    st = make_storage("memory://locks-race/c")
    for r in range(ROUNDS):
        barrier, won = threading.Barrier(N_RACERS), []

        def racer(me: int, r: int = r, barrier: threading.Barrier = barrier, won: list = won) -> None:
            barrier.wait()
            if st.create_exclusive(f"race/k{r}", f"racer {me}".encode()):
                won.append(me)

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(N_RACERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and st.get(f"race/k{r}") == f"racer {won[0]}".encode()


# -- the staleness rule ----------------------------------------------------------------------------------


def test_a_holder_on_this_host_is_alive_while_its_process_runs_with_the_recorded_start(monkeypatch):
    monkeypatch.delenv("DFLASH_HOST_ID", raising=False)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        rec = HolderRecord(host=locks.host_name(), pid=child.pid, pidns=locks.pid_namespace(),
                           start=locks.process_start(child.pid), heartbeat_unix=time.time() - 10**6)
        assert rec.in_this_namespace() and rec.alive(1.0)  # the pid decides here, not the (ancient) heartbeat
        reused = HolderRecord(**{**rec.__dict__, "start": "1"})  # the same pid, another process
        assert not reused.alive(10**9)
    finally:
        child.communicate(b"")
    assert not rec.alive(10**9)  # it ended


def test_a_holder_on_another_host_is_judged_by_its_heartbeat(monkeypatch):
    monkeypatch.setenv("DFLASH_HOST_ID", "node-a")
    rec = HolderRecord.mine(gen=1, token="t")
    assert rec.host == "node-a" and rec.pidns == "host-id:node-a"
    assert rec.alive(60.0, holds=lambda token: token == "t")  # this process, still holding it
    monkeypatch.setenv("DFLASH_HOST_ID", "node-b")  # the same record seen from another host
    assert not rec.in_this_namespace()
    assert rec.alive(60.0)
    old = HolderRecord(**{**rec.__dict__, "heartbeat_unix": time.time() - 61.0})
    assert not old.alive(60.0)  # stale by its heartbeat, although its pid (this process) runs
    monkeypatch.delenv("DFLASH_HOST_ID")
    assert not rec.in_this_namespace()  # a host id is never this host's own namespace


def test_a_record_without_a_namespace_is_never_judged_by_pid():
    rec = HolderRecord(host="x", pid=os.getpid(), heartbeat_unix=time.time() - 100)
    assert not rec.in_this_namespace() and not rec.alive(50.0) and rec.alive(200.0)


def test_heartbeat_advances_is_judged_on_this_hosts_clock():
    skewed = HolderRecord(host="node-b", pid=1, pidns="host-id:node-b", heartbeat_unix=time.time() + 3600)
    seen = {"rec": skewed}
    assert heartbeat_advances(lambda: seen["rec"], skewed, window_s=0.3, poll_s=0.05) is None  # silent

    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.02):
            seen["rec"] = HolderRecord(**{**seen["rec"].__dict__, "heartbeat_unix": seen["rec"].heartbeat_unix + 1})

    t = threading.Thread(target=beat)
    t.start()
    try:
        assert heartbeat_advances(lambda: seen["rec"], skewed, window_s=60.0, poll_s=0.02) is not None
    finally:
        stop.set()
        t.join()
    assert heartbeat_advances(lambda: None, skewed, window_s=60.0, poll_s=0.02) is None  # the record vanished


# -- heartbeat, takeover, release on a generation lock ---------------------------------------------------


def _take(st, keeper: Keeper, timeout_s: float = 600.0):
    return take_generation(lambda g: GenerationLock(st, "lock", g, keeper),
                           lambda: newest_generation(st, "lock", "lock", GenerationLock.parse),
                           lambda h: h is not None and h.alive(timeout_s, keeper.holds))


@pytest.mark.parametrize("url", ["local", "memory://locks-gen/c"])
def test_heartbeat_refreshes_every_held_lock_and_stops_at_release(tmp_path, url):
    st = LocalStorage(str(tmp_path / "s")) if url == "local" else make_storage(url)
    keeper = Keeper(lambda: 0.02)
    lock, prev = _take(st, keeper)
    assert prev is None and lock.gen == 1 and lock.held()
    first = newest_generation(st, "lock", "lock", GenerationLock.parse)[1].heartbeat_unix
    _wait(lambda: newest_generation(st, "lock", "lock", GenerationLock.parse)[1].heartbeat_unix > first,
          "a heartbeat")
    lock.release(remove_dir=True)
    assert newest_generation(st, "lock", "lock", GenerationLock.parse) == (0, None)
    lock.beat()  # a late beat of a released lock writes nothing
    assert newest_generation(st, "lock", "lock", GenerationLock.parse) == (0, None)
    again, _ = _take(st, keeper)
    assert again.gen == 1  # released: the next holder starts afresh
    again.release(remove_dir=True)


def test_a_stale_holder_is_taken_over_and_its_late_beat_and_release_change_nothing(tmp_path):
    st = LocalStorage(str(tmp_path / "s"))
    keeper = Keeper(lambda: 3600.0)
    old, _ = _take(st, keeper)
    with pytest.raises(Contended) as held:
        _take(st, keeper)  # alive (this process, holding it)
    assert held.value.holder.token == old.token
    keeper.drop(old)  # as if its process had died (this process no longer holds the token)
    new, prev = _take(st, keeper)
    assert (new.gen, prev.token) == (2, old.token) and new.held() and not old.held()
    old.beat()  # never brings its generation back to the top
    old.release()  # superseded: removes nothing (its number may name another holder's file by now)
    assert new.held() and sorted(os.listdir(tmp_path / "s" / "lock")) == ["lock.000001.json", "lock.000002.json"]
    new.release()  # the holder removes its own and the older files
    assert os.listdir(tmp_path / "s" / "lock") == []


def test_a_stale_holder_elsewhere_is_taken_over_after_its_heartbeat_timeout(tmp_path):
    st = LocalStorage(str(tmp_path / "s"))
    (tmp_path / "s" / "lock").mkdir(parents=True)
    foreign = {"host": "node-b", "pid": 1, "pidns": "host-id:node-b", "start": "1", "token": "x"}
    path = tmp_path / "s" / "lock" / "lock.000001.json"
    path.write_text(json.dumps({**foreign, "heartbeat_unix": time.time() - 5}))
    keeper = Keeper(lambda: 3600.0)
    with pytest.raises(Contended):
        _take(st, keeper, timeout_s=60.0)
    path.write_text(json.dumps({**foreign, "heartbeat_unix": time.time() - 61}))
    lock, prev = _take(st, keeper, timeout_s=60.0)
    assert lock.gen == 2 and prev.host == "node-b"
    lock.release()


def test_the_heartbeat_thread_is_stopped_before_stop_returns():
    calls, started = [], threading.Event()

    def beat() -> None:
        calls.append(1)
        started.set()

    hb = Heartbeat(beat, 0.01, "test-heartbeat").start()
    assert started.wait(120)
    hb.stop()
    n = len(calls)
    assert not hb._thread.is_alive()  # joined: no beat can follow the release that comes after stop()
    assert len(calls) == n


def test_keeper_reports_a_failed_refresh_and_keeps_going():
    failed, ok = [], threading.Event()

    class Flaky:
        token = "f"
        n = 0

        def beat(self) -> None:
            self.n += 1
            if self.n == 1:
                raise OSError(28, "No space left on device")
            ok.set()

    keeper = Keeper(lambda: 0.01, on_error=lambda lock, err: failed.append(err.errno))
    keeper.add(Flaky())
    assert ok.wait(120) and failed == [28] and keeper.holds("f")


# -- the flock record file -------------------------------------------------------------------------------


def test_flock_file_is_exclusive_and_freed_when_its_holder_dies(tmp_path):
    path = tmp_path / "x.lock"
    mine = FlockFile(path, 256).open()
    assert mine.lock() == FlockFile.GRANTED
    mine.write(HolderRecord.mine().to_json(note="me"))
    other = FlockFile(path, 256).open()
    assert other.lock() == FlockFile.HELD and other.fd is None
    assert other.read()["pid"] == os.getpid() and other.read()["note"] == "me"
    mine.close()
    assert other.open().lock() == FlockFile.GRANTED
    other.close()

    script = ("import sys\nfrom dflash_cache.locks import FlockFile\nf = FlockFile(sys.argv[1]).open()\n"
              "assert f.lock() == 'granted'\nprint('held', flush=True)\nsys.stdin.read()\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert proc.stdout.readline().strip() == "held"
        assert FlockFile(path).open().lock() == FlockFile.HELD
    finally:
        proc.kill()
        proc.wait()
    late = FlockFile(path).open()
    assert late.lock() == FlockFile.GRANTED  # the kernel dropped the killed holder's lock
    late.close()

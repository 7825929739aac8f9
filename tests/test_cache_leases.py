"""Part leases: one live writer per part; dead writers' parts are taken over; nothing committed is
ever removed; files honour the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dflash_cache import lease as lease_mod
from dflash_cache import open_cache, verify_cache
from dflash_cache.errors import CacheError
from dflash_cache.lease import LeaseHeldError, LeaseLostError, PartCommittedError, acquire, lease_name, newest
from dflash_cache.storage import LocalStorage, make_storage
from dflash_cache.synthetic import make_synthetic_cache, synthetic_features

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = tmp_path / "c"
    make_synthetic_cache(str(url), 12, lengths=[40 + i for i in range(12)], samples_per_part=6,
                         bucket_edges=(64, 128), chunk_tokens=16, shard_tokens=64, seed=3)
    return url


def _fill(w, first_id: int, n: int = 3) -> None:
    g = torch.Generator().manual_seed(first_id)
    for i in range(n):
        w.add(first_id + i, torch.arange(70), torch.ones(70, dtype=torch.bool), synthetic_features(70, 3, 64, g))


_HOLDER = textwrap.dedent("""
    import sys, time
    from dflash_cache import open_cache
    cache = open_cache(sys.argv[1])
    w = cache.part_writer(1, "held", meta={"unit": 3})
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_live_writer_keeps_its_part_and_a_dead_one_is_taken_over(cache_dir):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(cache_dir)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "held"
        cache = open_cache(str(cache_dir))
        with pytest.raises(LeaseHeldError, match=f"pid {proc.pid} on host"):
            cache.part_writer(1, "held")
        assert cache.gc() == []  # gc keeps it too
        assert len(list((cache_dir / "buckets/1/held").glob("g000001-*/zarr.json"))) == 1  # nothing of it removed
    finally:
        proc.kill()
        proc.wait()
    with cache.part_writer(1, "held", meta={"unit": 3}) as w:  # the holder is gone: taken over, leftover cleared
        _fill(w, 1000)
    names = sorted(os.listdir(cache_dir / "buckets/1/held"))
    assert "commit.json" in names and not [n for n in names if n.startswith("lease.")]
    assert verify_cache(str(cache_dir)).n_samples == 15


def test_exactly_one_of_many_processes_wins_a_part(cache_dir):
    script = textwrap.dedent("""
        import sys
        from dflash_cache.lease import LeaseHeldError, acquire
        from dflash_cache.storage import make_storage
        try:
            lease = acquire(make_storage(sys.argv[1]), "buckets/1/contended")
        except LeaseHeldError:
            print("lost", flush=True)
        else:
            print("won", flush=True)
        sys.stdin.read()  # hold (or not) until told to finish
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(cache_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
             for _ in range(4)]
    outcomes = sorted(p.stdout.readline().strip() for p in procs)
    for p in procs:
        p.communicate("")
    assert outcomes == ["lost"] * 3 + ["won"]


def _foreign_lease(url: Path, key: str, heartbeat_age_s: float) -> None:
    rec = {"token": "t", "host": "elsewhere", "pid": 1, "pidns": "elsewhere/boot/1", "start": "1",
           "acquired_unix": time.time() - 1000, "heartbeat_unix": time.time() - heartbeat_age_s}
    (url / key).mkdir(parents=True)
    (url / key / lease_name(1)).write_text(json.dumps(rec))


def test_a_lease_from_another_host_counts_while_its_heartbeat_is_fresh(cache_dir):
    st = LocalStorage(str(cache_dir))
    _foreign_lease(cache_dir, "buckets/1/remote", heartbeat_age_s=5)
    with pytest.raises(LeaseHeldError, match="pid 1 on host elsewhere"):
        acquire(st, "buckets/1/remote")
    _foreign_lease(cache_dir, "buckets/1/stale", heartbeat_age_s=lease_mod.LEASE_TIMEOUT_S + 1)
    lease = acquire(st, "buckets/1/stale")
    assert lease.gen == 2 and lease.held()
    lease.release(remove_dir=True)
    assert not (cache_dir / "buckets/1/stale").exists()


def test_a_reused_pid_does_not_keep_a_dead_lease(cache_dir):
    st = LocalStorage(str(cache_dir))
    lease = acquire(st, "buckets/1/reused")
    rec = json.loads((cache_dir / lease.file).read_text())
    lease_mod._keeper.drop(lease)  # as if this were another process that died ...
    rec.update(token="other", pid=os.getppid(), start="0")  # ... whose pid now belongs to a running process
    (cache_dir / lease.file).write_text(json.dumps(rec))
    taken = acquire(st, "buckets/1/reused")
    assert taken.gen == 2
    taken.release(remove_dir=True)


def test_the_heartbeat_is_refreshed_while_held(cache_dir, monkeypatch):
    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.05)
    st = LocalStorage(str(cache_dir))
    fresh = lease_mod._Keeper()  # a keeper started with the short interval
    monkeypatch.setattr(lease_mod, "_keeper", fresh)
    lease = acquire(st, "buckets/1/beating")
    witness = acquire(st, "buckets/1/witness")  # held throughout: its heartbeats show the keeper's rounds

    def beats_after(key: str, since: float, n: int = 1) -> None:
        """Wait (generously) until ``key``'s heartbeat has been refreshed ``n`` times after ``since``."""
        deadline, seen, last = time.monotonic() + 120, 0, since
        while seen < n:
            assert time.monotonic() < deadline, f"the heartbeat of {key} was not refreshed"
            now = newest(st, key)[1].heartbeat_unix
            if now > last:
                seen, last = seen + 1, now
            time.sleep(0.01)

    beats_after(lease.key, newest(st, lease.key)[1].heartbeat_unix)
    lease.release()
    beats_after(witness.key, newest(st, witness.key)[1].heartbeat_unix, n=2)  # two rounds after the release
    assert newest(st, lease.key) == (0, None)  # released: the heartbeat does not bring it back
    witness.release()


def test_a_writer_that_lost_its_lease_neither_commits_nor_removes_the_new_owners_files(cache_dir):
    cache = open_cache(str(cache_dir))
    w = cache.part_writer(1, "lost")
    _fill(w, 2000)
    lease_mod._keeper.drop(w._lease)  # this process plays both sides: the writer's lease now looks dead ...
    taker = cache.part_writer(1, "lost")  # ... and another writer takes the part over
    _fill(taker, 3000)
    assert not (cache_dir / w.data_key).exists() and w.data_key != taker.data_key  # fenced off: removed
    with pytest.raises(LeaseLostError, match="taken over"):
        w.commit()
    assert not (cache_dir / w.key / "commit.json").exists()
    assert not (cache_dir / w.data_key).exists()  # its own generation only: garbage now
    assert (cache_dir / taker.data_key / "features").is_dir() and taker._lease.held()
    w.abort()  # a no-op after the failed commit
    taker.commit()
    assert verify_cache(str(cache_dir)).n_samples == 15


def test_committed_parts_are_never_removed(cache_dir):
    cache = open_cache(str(cache_dir))
    part = cache.parts()[0]
    with pytest.raises(PartCommittedError):
        acquire(cache.storage, part.key)
    with pytest.raises(PartCommittedError):
        cache.part_writer(part.bucket, part.name)
    assert cache.gc() == [] and verify_cache(str(cache_dir)).n_samples == 12


def test_fsspec_leases_are_exclusive():
    st = make_storage("memory://leases/c")
    first = acquire(st, "buckets/0/p")
    with pytest.raises(LeaseHeldError):
        acquire(st, "buckets/0/p")
    first.release(remove_dir=True)
    acquire(st, "buckets/0/p").release(remove_dir=True)
    assert st.list_dir("buckets/0") == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_cache_files_honour_the_umask(tmp_path, umask, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    old = os.umask(umask)
    try:
        make_synthetic_cache(str(tmp_path / "c"), 6, lengths=[40] * 6, bucket_edges=(64,), chunk_tokens=16,
                             shard_tokens=64)
    finally:
        os.umask(old)
    modes = {}
    for dirpath, dirs, files in os.walk(tmp_path / "c"):
        for name in dirs + files:
            p = Path(dirpath) / name
            modes[p.relative_to(tmp_path).as_posix()] = stat.S_IMODE(p.stat().st_mode)
    assert "c/head.safetensors" in modes and "c/buckets/0/syn0-b0-p00000/commit.json" in modes
    want_file, want_dir = 0o666 & ~umask, 0o777 & ~umask
    wrong = {k: oct(m) for k, m in modes.items() if m != (want_dir if (tmp_path / k).is_dir() else want_file)}
    assert wrong == {}


_CREATOR = textwrap.dedent("""
    import sys, time, torch
    from dflash_cache import CacheSpec, TeacherInfo, create_cache
    spec = CacheSpec(TeacherInfo("t", None, 4, 8, 16), [1, 2], "tok", 64, bucket_edges=[16, 32])
    while time.time() < float(sys.argv[2]):  # start together
        pass
    cache = create_cache(sys.argv[1], spec)
    cache.write_metadata("config", {"a": 1})
    if not (cache.has_head() and cache.head_record() is not None):
        cache.save_head(torch.ones(16, 8))
    cache.load_head()
""")


def test_concurrent_creators_of_one_cache_all_succeed(tmp_path):
    """Jobs started together on a new --out each create-or-open the cache, and its head is recorded."""
    go = str(time.time() + 4.0)
    procs = [subprocess.Popen([sys.executable, "-c", _CREATOR, str(tmp_path / "c"), go], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_CACHE_FSYNC": "1"},
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    assert open_cache(str(tmp_path / "c")).head_record() is not None


class _TakenAndGivenBack(LocalStorage):
    """Storage of a process whose lease creations meet other holders in a fixed order. In the first
    ``vanish`` creations of a lease file, between making the part directory and creating the temporary
    file in it, another holder takes the part and releases it, removing its empty directory (what a writer
    that aborts an empty part does): the directory is gone when this process writes into it. In the
    ``give_back`` creations before those, another holder creates the very generation first and gives it back
    before this process looks again. With ``keep``, the holder of the last meeting keeps the part."""

    def __init__(self, root: str, vanish: int = 0, give_back: int = 0, keep: bool = False):
        super().__init__(root)
        self.others = LocalStorage(root)  # the other holders: the same directory, without these meetings
        self.vanish, self.give_back, self.keep = vanish, give_back, keep
        self.giving_back = False
        self.met: list[str] = []  # what happened, in order
        self.kept = None

    def _last(self) -> bool:
        return self.vanish + self.give_back == 0

    def _new_temp(self, path, data, durable):
        if self.vanish and not self.giving_back and path.name.startswith("lease."):
            self.vanish -= 1
            other = acquire(self.others, "buckets/0/p")
            if self.keep and self._last():
                self.kept = other
            else:
                other.release(remove_dir=True)
                assert not path.parent.exists()
            self.met.append("vanished")
        return super()._new_temp(path, data, durable)

    def create_exclusive(self, key, data, durable=False):
        if not (self.give_back and key.rsplit("/", 1)[-1].startswith("lease.")):
            return super().create_exclusive(key, data, durable)
        self.give_back -= 1
        other = acquire(self.others, "buckets/0/p")
        assert other.file == key  # the generation this process is about to create
        self.giving_back = True
        try:
            created = super().create_exclusive(key, data, durable)
        finally:
            self.giving_back = False
        if self.keep and self._last():
            self.kept = other
        else:
            other.release(remove_dir=True)
        self.met.append("given back")
        return created


def test_racing_acquire_and_release_stay_exclusive(tmp_path):
    """An acquire whose part other holders take and give back under it, again and again (its empty directory
    removed while this process creates its lease file there, or the generation it creates taken first and
    released before it looks again), gets the part: a lost race is no error (it once raised
    FileNotFoundError('directory keeps disappearing') after five removals, or gave up after eight lost races)."""
    st = _TakenAndGivenBack(str(tmp_path / "c"), vanish=12, give_back=12)
    lease = acquire(st, "buckets/0/p")
    assert st.met == ["given back"] * 12 + ["vanished"] * 12
    assert lease.held() and newest(st, "buckets/0/p") == (lease.gen, newest(st, "buckets/0/p")[1])
    assert newest(st, "buckets/0/p")[1].token == lease.token
    lease.release(remove_dir=True)
    assert not (tmp_path / "c/buckets/0/p").exists()


@pytest.mark.parametrize("last", ["vanished", "given back"])
def test_an_acquire_that_meets_a_holder_which_keeps_the_part_names_it(tmp_path, last):
    """Of the same meetings, the last holder keeps the part: the acquire reports it (LeaseHeldError naming
    that holder), and holds nothing."""
    st = _TakenAndGivenBack(str(tmp_path / "c"), vanish=3 if last == "vanished" else 0,
                            give_back=3 if last == "given back" else 2, keep=True)
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()} on host"):
        acquire(st, "buckets/0/p")
    assert st.met[-1] == last and st.kept is not None and st.kept.held()
    assert newest(st, "buckets/0/p")[1].token == st.kept.token
    st.kept.release(remove_dir=True)


def test_an_acquire_that_loses_every_race_says_nobody_holds_the_part(tmp_path):
    """Other holders take and give back the generation it creates on every one of its tries: a clear error
    that says so (nobody holds the part; rerun), not a FileNotFoundError, and no lease left behind."""
    st = _TakenAndGivenBack(str(tmp_path / "c"), give_back=10_000)
    with pytest.raises(CacheError, match="took its lease and gave it back again on each of this process's tries"):
        acquire(st, "buckets/0/p")
    assert st.met == ["given back"] * 32 and newest(st, "buckets/0/p") == (0, None)


class _ReleasedWhileTakenOver(LocalStorage):
    """Storage of a process taking over a part whose holder is releasing it: the holder is already dead to
    everyone (dropped from its keeper, as ``release`` does first), and while this process creates the next
    generation, the holder finishes its release (its lease file and the empty directory removed) and another
    process takes the part afresh: generation 1 again, numbering restarted."""

    def __init__(self, root: str, releasing):
        super().__init__(root)
        self.others = LocalStorage(root)
        self.releasing, self.fresh = releasing, None

    def create_exclusive(self, key, data, durable=False):
        if self.releasing is not None and key.rsplit("/", 1)[-1].startswith("lease."):
            self.releasing.release(remove_dir=True)
            self.releasing = None
            self.fresh = acquire(self.others, "buckets/0/p")
            assert self.fresh.gen == 1
        return super().create_exclusive(key, data, durable)


def test_a_takeover_whose_numbering_restarted_under_it_does_not_hold_beside_the_fresh_holder(tmp_path):
    """The takeover created generation 2 above the released holder's 1 while a fresh holder took generation 1
    again: the higher number is not the newer holder. It withdraws and names the fresh holder (it once
    returned a lease as well: two holders of one part)."""
    first = acquire(LocalStorage(str(tmp_path / "c")), "buckets/0/p")
    lease_mod._keeper.drop(first)  # release() begins: dead to everyone from here on
    st = _ReleasedWhileTakenOver(str(tmp_path / "c"), first)
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()} on host"):
        acquire(st, "buckets/0/p")
    assert st.fresh is not None and st.fresh.held() and st.fresh.gen == 1
    assert sorted(os.listdir(tmp_path / "c/buckets/0/p")) == [lease_name(1)]  # its withdrawn generation 2 is gone
    assert newest(st, "buckets/0/p")[1].token == st.fresh.token
    st.fresh.release(remove_dir=True)


def test_threads_taking_and_giving_back_one_part_never_overlap(tmp_path):
    """Threads take and give back one part as fast as they can (a released empty part directory is
    removed, so creators race its removal) until they won it 150 times: never two holders, never an error.
    (The interleavings that once broke this are driven one by one in the tests above.)"""
    import threading

    st = LocalStorage(str(tmp_path / "c"))
    holding, overlaps, errors, wins = [], [], [], []
    lock = threading.Lock()
    deadline = time.monotonic() + 300

    def worker() -> None:
        while len(wins) < 150 and time.monotonic() < deadline:
            try:
                lease = acquire(st, "buckets/0/p")
            except LeaseHeldError:
                continue
            except Exception as err:  # noqa: BLE001 - collected for the assertion
                errors.append(repr(err))
                continue
            with lock:
                overlaps.append(len(holding))
                holding.append(lease)
            wins.append(1)
            with lock:
                holding.remove(lease)
            lease.release(remove_dir=True)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and set(overlaps) == {0} and len(wins) >= 150

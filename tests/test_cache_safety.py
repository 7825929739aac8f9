"""The cache's safety primitives under the conditions that break weaker versions of them:

- exclusive creation raced by many processes (threads for ``memory://``) released at one barrier, so that
  they really do arrive together: exactly one wins each key, and its bytes are the ones stored;
- ``verify`` given a valid shard copied from another part (zarr's own per-chunk checksums pass; only the
  commit record's whole-array checksum notices);
- the commit order, observed through a storage wrapper that records calls: every file of the part is
  fsynced before the commit record, and the commit record is created exclusively (never a plain put).

``tests/mutation_check.py`` breaks each primitive in a copy of the repository and checks these tests fail.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import threading
import time

import pytest
import torch

from dflash_cache import open_cache, verify_cache
from dflash_cache import storage as storage_mod
from dflash_cache.errors import CacheCorruptError
from dflash_cache.lease import LeaseHeldError, acquire
from dflash_cache.parts import COMMIT
from dflash_cache.storage import make_storage
from dflash_cache.synthetic import make_synthetic_cache, synthetic_features

N_PROCS, ROUNDS = 8, 40
DEADLINE_S = 300.0  # overall; a round normally takes milliseconds


def _slow_metadata_operations(delay_s: float) -> None:
    """Link, rename and replace take ``delay_s`` (as on a network filesystem): an implementation that checks
    and then writes leaves every contender time to pass the check. Only in the forked racers."""
    for name in ("link", "rename", "replace"):
        real = getattr(os, name)

        def slow(*args, _real=real, **kwargs):
            time.sleep(delay_s)
            return _real(*args, **kwargs)

        setattr(os, name, slow)


def _race_worker(url: str, barrier, results, index: int, what: str) -> None:
    """Run ROUNDS rounds; in each, wait at the barrier, then try to take key ``r``."""
    _slow_metadata_operations(0.005)
    st = make_storage(url)
    out = []
    for r in range(ROUNDS):
        barrier.wait(timeout=DEADLINE_S)
        if what == "create":
            won = st.create_exclusive(f"race/{r:03d}", f"{index}".encode())
        else:
            try:
                acquire(st, f"buckets/0/p{r:03d}")
                won = True
            except LeaseHeldError:
                won = False
        out.append(won)
    results.put((index, out))
    if what == "lease":  # winners hold their leases (alive) until every result is in
        barrier.wait(timeout=DEADLINE_S)


def _race_processes(url: str, what: str) -> list[list[bool]]:
    ctx = multiprocessing.get_context("fork")  # the workers need nothing but this module's function
    barrier, results = ctx.Barrier(N_PROCS + (1 if what == "lease" else 0)), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(url, barrier, results, i, what)) for i in range(N_PROCS)]
    for p in procs:
        p.start()
    try:
        if what == "lease":
            for _ in range(ROUNDS):  # this process takes part in each round's barrier, not in the race
                barrier.wait(timeout=DEADLINE_S)
        got = dict(results.get(timeout=DEADLINE_S) for _ in procs)
        if what == "lease":
            barrier.wait(timeout=DEADLINE_S)
    finally:
        for p in procs:
            p.join(timeout=DEADLINE_S)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [got[i] for i in range(N_PROCS)]


def _one_winner_per_round(wins: list[list[bool]]) -> list[int]:
    counts = [sum(w[r] for w in wins) for r in range(ROUNDS)]
    assert counts == [1] * ROUNDS, f"winners per round: {counts}"
    return [next(i for i, w in enumerate(wins) if w[r]) for r in range(ROUNDS)]


@pytest.mark.parametrize("scheme", ["path", "file://"])
def test_exclusive_create_raced_by_processes_at_a_barrier_has_one_winner(tmp_path, scheme, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = str(tmp_path) if scheme == "path" else f"file://{tmp_path}"
    winners = _one_winner_per_round(_race_processes(url, "create"))
    for r, i in enumerate(winners):  # the stored bytes are the winner's, complete
        assert (tmp_path / f"race/{r:03d}").read_bytes() == f"{i}".encode()
    assert not [p for p in (tmp_path / "race").iterdir() if p.name.endswith(".partial")]


def test_part_leases_raced_by_processes_at_a_barrier_have_one_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    _one_winner_per_round(_race_processes(str(tmp_path), "lease"))


def test_exclusive_create_raced_by_threads_on_memory_storage_has_one_winner():
    """``memory://`` lives in one process, so its contenders are threads. Its existence check answers late (as
    a remote one would), so a check-then-write without mutual exclusion lets several threads through."""
    st = make_storage("memory://safety-race")
    real_exists = st.fs.exists

    def slow_exists(path, **kw):
        found = real_exists(path, **kw)
        time.sleep(0.002)  # the answer is on its way while another thread writes
        return found

    barrier = threading.Barrier(N_PROCS)
    wins = [[False] * ROUNDS for _ in range(N_PROCS)]

    def run(i: int) -> None:
        for r in range(ROUNDS):
            barrier.wait(timeout=DEADLINE_S)
            wins[i][r] = st.create_exclusive(f"race/{r:04d}", f"{i}".encode())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_PROCS)]
    st.fs.exists = slow_exists
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=DEADLINE_S)
    finally:
        del st.fs.exists
    try:
        winners = _one_winner_per_round(wins)
        for r, i in enumerate(winners):
            assert st.get(f"race/{r:04d}") == f"{i}".encode()
    finally:
        st.remove_tree("")


# ------------------------------------------------------------------------------------------------
# verify: a valid shard from another part
# ------------------------------------------------------------------------------------------------


def test_verify_catches_a_valid_shard_copied_from_another_part(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = tmp_path / "c"
    make_synthetic_cache(str(url), 24, lengths=[100 + i for i in range(24)], samples_per_part=8,
                         bucket_edges=(64, 128), chunk_tokens=16, shard_tokens=64, seed=3)
    parts = open_cache(str(url)).parts()
    a, b = [p for p in parts if p.bucket == parts[0].bucket][:2]
    shard_a, shard_b = (url / p.data_key / "features" / "c" / "0" / "0" for p in (a, b))
    assert shard_a.read_bytes() != shard_b.read_bytes()
    assert verify_cache(str(url)).ok
    shutil.copyfile(shard_b, shard_a)  # a complete, self-consistent shard: only its contents are wrong
    cache = open_cache(str(url))
    # the shard's own checksums pass; the reader refuses it because the commit record binds each shard's
    # index checksum, and verify names the part and array
    with pytest.raises(CacheCorruptError, match="not the one its commit record names") as read_err:
        cache.read_samples([int(cache.index().sample_ids[0])])
    assert (read_err.value.part, read_err.value.array) == (a.key, "features")
    with pytest.raises(CacheCorruptError, match="not the one its commit record names") as err:
        verify_cache(str(url))
    assert (err.value.part, err.value.array) == (a.key, "features")


def _drop_chunk_tables(url, part) -> None:
    """Rewrite ``part``'s commit record as records were before they kept each shard's chunk table and copies
    of sample_ids and offsets (the reader then reads the shard's index and those arrays from storage)."""
    path = url / part.key / "commit.json"
    rec = json.loads(path.read_bytes())
    for a in rec["arrays"].values():
        a.pop("shard_chunks", None)
        a.pop("inline", None)
    path.write_text(json.dumps(rec, indent=1))


@pytest.mark.parametrize("record", ["chunk_tables", "no_chunk_tables"])
def test_verify_catches_a_shard_of_another_part_whose_index_is_the_same(tmp_path, monkeypatch, record):
    """Uncompressed parts of equal length: the copied shard's index, and so the checksum the record binds,
    is the same as the original's. The record's chunk table (each chunk's crc32c) tells them apart at read
    time; in a record without one, only verify's whole-array checksum of the contents does."""
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = tmp_path / "c"
    make_synthetic_cache(str(url), 24, lengths=[100] * 24, samples_per_part=8, bucket_edges=(64, 128),
                         chunk_tokens=16, shard_tokens=64, seed=3, codec="bf16-raw")
    parts = open_cache(str(url)).parts()
    a, b = [p for p in parts if p.bucket == parts[0].bucket][:2]
    assert a.arrays["features"]["shard_index_crc32c"] == b.arrays["features"]["shard_index_crc32c"]
    shard_a, shard_b = (url / p.data_key / "features" / "c" / "0" / "0" for p in (a, b))
    assert shard_a.read_bytes() != shard_b.read_bytes()
    if record == "no_chunk_tables":
        _drop_chunk_tables(url, a)
    assert verify_cache(str(url)).ok
    shutil.copyfile(shard_b, shard_a)
    cache = open_cache(str(url))
    first = int(cache.index().sample_ids[0])
    if record == "no_chunk_tables":
        cache.read_samples([first])  # the reader's checks pass: chunk and index checksums
        with pytest.raises(CacheCorruptError, match="crc32c of the data differs") as err:
            verify_cache(str(url))
    else:
        with pytest.raises(CacheCorruptError, match="not the one its commit record names") as read_err:
            cache.read_samples([first])
        assert (read_err.value.part, read_err.value.array) == (a.key, "features")
        with pytest.raises(CacheCorruptError, match="not the one its commit record names") as err:
            verify_cache(str(url))
    assert (err.value.part, err.value.array) == (a.key, "features")


# ------------------------------------------------------------------------------------------------
# commit order
# ------------------------------------------------------------------------------------------------


class RecordingStorage:
    """Delegates to a real storage and records the calls that decide durability and exclusivity."""

    def __init__(self, inner, events: list):
        self._inner, self.events = inner, events

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def put(self, key, data, durable=False):
        self.events.append(("put", key, durable))
        return self._inner.put(key, data, durable)

    def create_exclusive(self, key, data, durable=False):
        self.events.append(("create_exclusive", key, durable))
        return self._inner.create_exclusive(key, data, durable)

    def sync_tree(self, prefix):
        self.events.append(("sync_tree", prefix))
        return self._inner.sync_tree(prefix)


def test_commit_makes_the_tree_durable_then_creates_the_record_exclusively(tmp_path, monkeypatch):
    url = tmp_path / "c"
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    make_synthetic_cache(str(url), 4, lengths=[70] * 4, samples_per_part=4, bucket_edges=(64, 128),
                         chunk_tokens=16, shard_tokens=64, seed=1)
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "1")
    events: list = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # which file (or directory) each fsync made durable
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(storage_mod.os, "fsync", fsync)
    cache = open_cache(str(url))
    cache.storage = RecordingStorage(cache.storage, events)
    g = torch.Generator().manual_seed(5)
    with cache.part_writer(1, "recorded") as w:
        for i in range(3):
            w.add(1000 + i, torch.arange(70), torch.ones(70, dtype=torch.bool), synthetic_features(70, 3, 64, g))
    part = url / "buckets" / "1" / "recorded"
    commit_key = "buckets/1/recorded/" + COMMIT
    assert ("put", commit_key, True) not in events and ("put", commit_key, False) not in events
    created = [i for i, e in enumerate(events) if e[:2] == ("create_exclusive", commit_key)]
    assert len(created) == 1 and events[created[0]][2] is True, events[-5:]
    before = events[:created[0]]
    # the fenced protocol: the generation's data made durable, then the generation sealed for the commit
    # (durably), then the record that names the generation
    gen_key = w.data_key  # buckets/1/recorded/g000001-<the writer's token>
    seal = f"{gen_key}.seal"
    assert ("sync_tree", gen_key) in before, before[-6:]
    sealed = [i for i, e in enumerate(before) if e[:2] == ("create_exclusive", seal)]
    assert len(sealed) == 1 and before[sealed[0]][2] is True, before[-6:]
    assert before.index(("sync_tree", gen_key)) < sealed[0]
    synced = {e[1] for e in before if e[0] == "fsync"}
    # the part's group document, written whole before the record: durable too (verify requires it)
    assert ("put", "buckets/1/recorded/zarr.json", True) in before
    data_files = {str(p) for p in (url / gen_key).rglob("*") if p.is_file()}
    assert data_files and data_files <= synced, sorted(data_files - synced)
    # every directory of the part, and the part's entry in its bucket, too
    dirs = {str(p) for p in part.rglob("*") if p.is_dir()} | {str(part), str(part.parent)}
    assert dirs <= synced, sorted(dirs - synced)
    assert verify_cache(str(url)).ok


# ------------------------------------------------------------------------------------------------
# each chunk of a read checked against the record; the lease rule and the seal, each alone
# ------------------------------------------------------------------------------------------------


def test_every_chunk_of_a_read_range_is_checked_against_the_record_not_only_the_first(tmp_path, monkeypatch):
    """A run of later chunks spliced in from another part (each with a valid chunk checksum of its own, and
    the shards' indexes equal: uncompressed parts of equal length) is refused by a read that starts at
    an untouched chunk, as verify refuses it."""
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = tmp_path / "c"
    make_synthetic_cache(str(url), 24, lengths=[100] * 24, samples_per_part=8, bucket_edges=(64, 128),
                         chunk_tokens=16, shard_tokens=64, seed=3, codec="bf16-raw")
    parts = open_cache(str(url)).parts()
    a, b = [p for p in parts if p.bucket == parts[0].bucket][:2]
    shard_a, shard_b = (url / p.data_key / "features" / "c" / "0" / "0" for p in (a, b))
    chunk = 16 * a.arrays["features"]["shape"][1] * 2 + 4  # an uncompressed chunk and its crc32c
    raw_a, raw_b = shard_a.read_bytes(), shard_b.read_bytes()
    shard_a.write_bytes(raw_a[:chunk] + raw_b[chunk:4 * chunk] + raw_a[4 * chunk:])  # chunks 1-3 from part b
    cache = open_cache(str(url))
    part = next(p for p in cache.parts() if p.key == a.key)
    assert cache.read_tokens(part, 0, 16).shape == (16, a.arrays["features"]["shape"][1])  # chunk 0: a's own
    with pytest.raises(CacheCorruptError, match="chunk 1 of shard .* is not the one its commit record names"):
        cache.read_tokens(part, 0, 64)  # one run over chunks 0-3: chunk 1 is the first spliced one
    with pytest.raises(CacheCorruptError, match="not the one its commit record names"):
        verify_cache(str(url))


def _writer_with_data(url, name: str):
    cache = open_cache(str(url))
    w = cache.part_writer(1, name)
    g = torch.Generator().manual_seed(11)
    for i in range(2):
        w.add(6000 + i, torch.arange(70), torch.ones(70, dtype=torch.bool), synthetic_features(70, 3, 64, g))
    return cache, w


def test_nobody_else_takes_a_part_while_its_holder_is_live(tmp_path, monkeypatch):
    """The lease rule alone: while the writer holds the part (this process, alive), another acquire is
    refused -- not merely beaten later by the seal -- and the holder commits."""
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = tmp_path / "c"
    make_synthetic_cache(str(url), 4, lengths=[70] * 4, samples_per_part=4, bucket_edges=(64, 128),
                         chunk_tokens=16, shard_tokens=64, seed=3)
    cache, w = _writer_with_data(url, "held")
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
        acquire(cache.storage, w.key)
    assert sorted(n for n in os.listdir(url / w.key) if n.startswith("lease.")) == ["lease.000001.json"]
    info = w.commit()
    assert info.data_key == w.data_key and verify_cache(str(url)).ok


def test_a_writer_that_lost_its_lease_never_commits_even_before_its_generation_is_sealed_dead(tmp_path,
                                                                                              monkeypatch):
    """The writer's own lease check alone: another process took the lease (and has not fenced the old
    generation off yet, so the seal does not stop it); the late writer's commit is refused."""
    from dflash_cache import lease as lease_mod
    from dflash_cache.lease import LeaseLostError

    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")
    url = tmp_path / "c"
    make_synthetic_cache(str(url), 4, lengths=[70] * 4, samples_per_part=4, bucket_edges=(64, 128),
                         chunk_tokens=16, shard_tokens=64, seed=3)
    cache, w = _writer_with_data(url, "late")
    lease_mod._keeper.drop(w._lease)  # its process looks dead from here on
    taker = acquire(cache.storage, w.key)  # the lease only: nothing sealed dead, nothing removed yet
    assert not (url / w.key / f"{w.generation.dir}.seal").exists()
    with pytest.raises(LeaseLostError, match="taken over"):
        w.commit()
    assert not (url / w.key / COMMIT).exists()
    taker.release(remove_dir=True)


def test_the_commit_seal_and_the_dead_seal_exclude_each_other(tmp_path):
    """The seal alone, without leases: of a remover and a committing writer of one generation, the first to
    seal wins and the other backs off, whichever comes first (on local disk and memory://)."""
    from dflash_cache.fence import discard_generation, seal_for_commit, seal_key
    from dflash_cache.parts import Generation

    for url in (str(tmp_path / "s"), f"memory://seal-{tmp_path.name}/s"):
        st = make_storage(url)
        gen = Generation(1, "0123456789abcdef")
        st.put(f"buckets/0/p/{gen.dir}/features/zarr.json", b"{}")
        assert discard_generation(st, "buckets/0/p", gen)  # the remover first: sealed dead, files removed
        assert not seal_for_commit(st, "buckets/0/p", gen, b"{}")  # the writer backs off
        assert st.get(seal_key("buckets/0/p", gen)) == b"dead"
        other = Generation(2, "fedcba9876543210")
        st.put(f"buckets/0/p/{other.dir}/features/zarr.json", b"{}")
        assert seal_for_commit(st, "buckets/0/p", other, b"{}")  # the writer first: sealed for its commit
        assert not discard_generation(st, "buckets/0/p", other)  # the remover backs off, files kept
        assert st.exists(f"buckets/0/p/{other.dir}/features/zarr.json")
        assert st.get(seal_key("buckets/0/p", other)).startswith(b"commit")

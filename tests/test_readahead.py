"""The loader's read-ahead: the same batches bitwise (and the same resume) from a modelled object store
as from local disk read in place, in a few coalesced range requests, within its memory budget."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import dflash_cache.latency_fs as latency_fs
from dflash_cache import open_cache
from dflash_cache.readahead import ReadAhead, ReadAheadSettings, coalesce
from dflash_cache.synthetic import make_synthetic_cache
from train.config import LoaderConfig
from train.data.loader import StreamingLoader

N = 400
BLOCKS = {"num_anchors": 512, "block_size": 16}


@pytest.fixture(scope="module")
def cache_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("readahead") / "cache")
    make_synthetic_cache(path, n_samples=N, seed=4)
    return path


def _cfg(**kw) -> LoaderConfig:
    base = {"tokens_per_batch": 1024, "num_readers": 2, "max_buffer_bytes": 1 << 24, "holdout_fraction": 0.0}
    return LoaderConfig(**{**base, **kw})


def _digest(batches) -> str:
    h = hashlib.sha256()
    for b in batches:
        for t in (b.features.view(torch.int16), b.input_ids, b.loss_mask, b.doc_ids, b.position_ids, b.sample_ids):
            h.update(t.contiguous().numpy().tobytes())
        h.update(repr((b.bucket, b.epoch, b.index, b.seed, b.n_tokens, b.n_padded)).encode())
    return h.hexdigest()


def _epochs(url: str, epochs: int = 2, **kw) -> tuple[list, StreamingLoader]:
    loader = StreamingLoader(open_cache(url), _cfg(**kw), **BLOCKS, seed=7, max_epochs=epochs)
    out = []
    with loader:
        while loader.epoch < epochs:
            out.extend(loader)
    return out, loader


def test_coalesce_merges_near_ranges_of_one_object_within_the_request_cap() -> None:
    ranges = [("a", 0, 10), ("a", 15, 30), ("a", 100, 120), ("b", 0, 5), ("a", 28, 40)]
    assert coalesce(ranges, gap=5, max_bytes=1000) == [("a", 0, 40), ("a", 100, 120), ("b", 0, 5)]
    assert coalesce(ranges, gap=100, max_bytes=1000) == [("a", 0, 120), ("b", 0, 5)]
    assert coalesce(ranges, gap=100, max_bytes=35) == [("a", 0, 30), ("a", 28, 40), ("a", 100, 120), ("b", 0, 5)]
    assert coalesce([("a", 0, 500)], gap=0, max_bytes=10) == [("a", 0, 500)]  # one range is never split


class _MemoryRanges:
    """A storage whose range reads return zeros and are recorded (key, start, end)."""

    is_local, url = False, "memory://ranges"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._lock:
            self.calls.append((key, start, end))
        return bytes(end - start)


def test_the_first_batch_is_split_over_every_stream_and_handed_out_before_the_horizon_is_planned() -> None:
    """Time to the first batch: its bytes come in requests_in_flight pieces at once (a wide request streams
    at one connection's rate), and it is handed out before the items after it are planned; the batches
    after it are fetched in wide requests again."""
    mib = 1 << 20
    items = list(range(24))  # each item: 40 samples of 200 KB, one after another in shard object "s"
    def ranges_of(i: int) -> list[tuple[str, int, int]]:
        planned.append(i)
        return [("s", (i * 40 + j) * 200_000, (i * 40 + j + 1) * 200_000) for j in range(40)]
    planned: list[int] = []
    store = _MemoryRanges()
    ahead = ReadAhead(store, ReadAheadSettings(read_ahead_bytes=64 * mib, requests_in_flight=8,
                                               coalesce_gap_bytes=mib, max_request_bytes=16 * mib), ranges_of)
    try:
        stream = ahead.wrap(iter(items))
        assert next(stream) == 0
        # only the first walk step (8 items) was planned before it was handed out, not the horizon (16 items)
        assert planned == items[:len(planned)] and len(planned) <= 8, planned
        ahead.done(0)
        rest = list(stream)
        assert rest == items[1:] and sorted(set(planned)) == items
    finally:
        ahead.close()
    first = [c for c in store.calls if c[2] <= 40 * 200_000]
    assert len(first) == 8 and max(b - a for _, a, b in first) <= 1_000_000 + 200_000, first
    assert sum(b - a for _, a, b in first) == 40 * 200_000  # exactly the first batch's bytes
    later = [b - a for _, a, b in store.calls if a >= 40 * 200_000]
    assert later and max(later) > 8 * mib, later  # then wide requests again


def test_store_batches_equal_local_batches_in_few_requests(cache_path: str) -> None:
    local, _ = _epochs(cache_path, read_ahead="off")
    latency_fs.configure(0, 0)
    latency_fs.reset_counters()
    remote, loader = _epochs(f"latency://{cache_path}", read_ahead="auto")
    assert _digest(remote) == _digest(local)
    c = loader.read_counters.as_dict()
    samples = sum(len(b.sample_ids) for b in remote)
    assert c["direct_requests"] == 0 and c["requests"] > 0, c
    # the budget holds the whole cache (both epochs' ranges are coalesced into the same blocks): every
    # stored feature byte is fetched, and none more than once per epoch
    stored = sum(p.feature_bytes for p in open_cache(cache_path).parts())
    assert c["bytes_decoded"] > 0 and 0.9 * stored <= c["bytes_fetched"] <= 2 * stored, (c, stored)
    assert c["requests"] / samples <= 0.1, (c, samples)
    assert latency_fs.counters()["requests"] >= c["requests"]


def test_a_small_read_ahead_budget_bounds_memory_and_keeps_the_batches(cache_path: str) -> None:
    local, _ = _epochs(cache_path, epochs=1, read_ahead="off")
    budget = 256 << 10
    remote, loader = _epochs(f"latency://{cache_path}", epochs=1, read_ahead="on", read_ahead_bytes=budget,
                             requests_in_flight=3)
    assert _digest(remote) == _digest(local)
    assert loader._read_ahead is not None
    held = loader._read_ahead.max_held
    largest_item = max(b.features.numel() * 2 for b in remote)  # decoded bytes bound one walk step's fetch
    assert 0 < held <= 2 * budget + 3 * largest_item, (held, budget)  # budget + gaps + items being decoded
    assert loader.read_counters.requests > 2  # many groups, not one


def test_resume_through_read_ahead_is_bitwise(cache_path: str) -> None:
    url = f"latency://{cache_path}"
    full, _ = _epochs(url, read_ahead="on")
    cut = int(np.random.default_rng().integers(1, len(full) - 1))
    first = StreamingLoader(open_cache(url), _cfg(read_ahead="on"), **BLOCKS, seed=7, max_epochs=2)
    got = []
    while len(got) < cut:
        for b in first:
            got.append(b)
            if len(got) == cut:
                break
    state = first.state_dict()
    first.close()
    resumed = StreamingLoader(open_cache(url), _cfg(read_ahead="on"), **BLOCKS, seed=7, max_epochs=2)
    resumed.load_state_dict(state)
    rest = []
    with resumed:
        while resumed.epoch < 2:
            rest.extend(resumed)
    assert _digest(got + rest) == _digest(full)


def test_commit_scan_and_verify_overlap_their_requests_and_agree_with_local(tmp_path) -> None:
    from dflash_cache import verify_cache
    from dflash_cache.synthetic import make_synthetic_cache

    path = str(tmp_path / "cache")
    make_synthetic_cache(path, n_samples=160, samples_per_part=8, seed=2)  # 20+ parts
    local = open_cache(path).parts()
    latency_fs.configure(5, 0)
    try:
        latency_fs.reset_counters()
        remote = open_cache(f"latency://{path}").parts()
        assert [(p.key, p.n_samples, p.n_tokens) for p in remote] == [(p.key, p.n_samples, p.n_tokens) for p in local]
        assert latency_fs.counters()["max_in_flight"] > 1  # commit records read concurrently
        # damage one part: the parallel verify reports exactly what a one-thread verify reports
        shard = sorted(Path(path).glob("buckets/*/*/g*/features/c/0/0"))[0]
        raw = bytearray(shard.read_bytes())
        raw[100] ^= 0xFF
        shard.write_bytes(bytes(raw))
        latency_fs.reset_counters()
        parallel = verify_cache(f"latency://{path}", raise_on_error=False)
        assert latency_fs.counters()["max_in_flight"] > 1
    finally:
        latency_fs.configure(0, 0)
    serial = verify_cache(path, raise_on_error=False, threads=1)
    assert not serial.ok and [str(p) for p in parallel.problems] == [str(p) for p in serial.problems]
    assert (parallel.n_parts, parallel.n_samples) == (serial.n_parts, serial.n_samples)


def _parts_seen(plan, table_part: np.ndarray, bucket: int) -> list[set[int]]:
    return [{int(table_part[p]) for p in b.positions} for b in plan.batches if b.bucket == bucket]


def test_locality_plans_each_sample_once_and_keeps_to_few_parts_at_a_time(cache_path: str) -> None:
    from train.data.plan import Planner, PlanSettings

    index = open_cache(cache_path).index()
    part = np.asarray(index.part)
    base = PlanSettings(seed=3, num_anchors=512, block_size=16, tokens_per_batch=1024)
    for world in (1, 2):
        local = PlanSettings(**{**base.__dict__, "locality_parts": 1, "world_size": world})
        planner = Planner(index.sample_ids, index.lengths, index.buckets, local, parts=part)
        plans = [planner.plan(0, rank=r) for r in range(world)]
        ids = np.concatenate([index.sample_ids[b.positions] for p in plans for b in p.batches])
        assert sorted(ids.tolist()) == sorted(index.sample_ids.tolist())  # every sample once
    plan = Planner(index.sample_ids, index.lengths, index.buckets,
                   PlanSettings(**{**base.__dict__, "locality_parts": 1}), parts=part).plan(0)
    full = Planner(index.sample_ids, index.lengths, index.buckets, base, parts=part).plan(0)
    assert plan.identity != full.identity
    assert full.identity == Planner(index.sample_ids, index.lengths, index.buckets, base).plan(0).identity
    multi = 0
    for bucket in sorted(set(int(b) for b in index.buckets)):
        seen_local, seen_full = _parts_seen(plan, part, bucket), _parts_seen(full, part, bucket)
        # one part per group: a batch draws from one part (two where a sort window straddles groups), and
        # the bucket's batches visit each part in one run
        assert max(len(s) for s in seen_local) <= 2
        runs = [min(s) for s in seen_local]
        switches = sum(1 for a, b in zip(runs, runs[1:], strict=False) if a != b)
        assert switches <= 2 * len(set().union(*seen_local)), (bucket, switches)
        multi += sum(len(s) > 1 for s in seen_full)
    assert multi > 0  # the full shuffle mixes parts in a batch: the comparison means something


def test_locality_cuts_requests_per_sample_through_the_read_ahead(cache_path: str) -> None:
    budget = 1 << 20  # a read-ahead far smaller than the cache: locality decides the request count
    shuffled, a = _epochs(f"latency://{cache_path}", epochs=1, read_ahead="on", read_ahead_bytes=budget)
    local_order, b = _epochs(f"latency://{cache_path}", epochs=1, read_ahead="on", read_ahead_bytes=budget,
                             locality_parts=1)
    n = sum(len(x.sample_ids) for x in shuffled)
    assert n == sum(len(x.sample_ids) for x in local_order) == N
    assert sorted(torch.cat([x.sample_ids for x in local_order]).tolist()) == list(range(N))
    per_sample = b.read_counters.requests / n
    assert per_sample < a.read_counters.requests / n, (per_sample, a.read_counters.requests / n)


def test_locality_runs_bring_requests_per_sample_to_a_tenth(tmp_path) -> None:
    path = str(tmp_path / "cache")
    make_synthetic_cache(path, n_samples=512, samples_per_part=128, bucket_edges=(), median_length=64, seed=5,
                         chunk_tokens=256, shard_tokens=16384)  # the default layout; ~13 MiB of features
    parts = open_cache(path).parts()
    assert min(p.n_samples for p in parts) >= 100
    url = f"latency://{path}"
    ahead = {"read_ahead": "on", "read_ahead_bytes": 4 << 20}  # a third of the cache
    shuffled, a = _epochs(url, epochs=1, **ahead)
    latency_fs.reset_counters()
    runs, b = _epochs(url, epochs=1, **ahead, locality_parts=1, locality_run_samples=32)
    every = latency_fs.counters()["by_kind"]
    assert sorted(torch.cat([x.sample_ids for x in runs]).tolist()) == list(range(512))
    per_sample, before = b.read_counters.requests / 512, a.read_counters.requests / 512
    assert per_sample <= 0.1 < before, (per_sample, before)
    assert b.read_counters.direct_requests == 0
    # every request from opening the cache to the end of the epoch: commit records, small arrays, listings
    assert sum(every.values()) / 512 <= 0.1, every


def test_a_remote_epoch_reads_each_parts_metadata_once(cache_path: str) -> None:
    """Through the read-ahead on a remote store: one request per commit record and per small array of each
    part (input_ids, loss_mask; sample_ids, offsets and every shard's chunk table come with the commit record,
    which two scans share, and the stored sample_ids and offsets are read once to check those copies), and
    no request for a shard's index."""
    url = f"latency://{cache_path}"
    n_parts = len(open_cache(url).parts())
    latency_fs.reset_counters()
    batches, loader = _epochs(url, epochs=1, read_ahead="on")
    kinds = latency_fs.counters()["by_kind"]
    assert sum(len(b.sample_ids) for b in batches) == N
    assert kinds.get("head", 0) <= 1, kinds  # (open_cache: does the root exist)
    assert kinds["commit record"] == n_parts, (kinds, n_parts)
    # input_ids, loss_mask; and the stored sample_ids and offsets, compared once with the record's copies
    assert kinds["small array"] == 4 * n_parts, (kinds, n_parts)
    assert kinds["feature range"] == loader.read_counters.requests  # (no shard index read)


class _FileRanges(_MemoryRanges):
    """A storage that reads into the caller's buffer (as LocalStorage does): byte i of object "s" is i % 251."""

    reads_into = True

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        with self._lock:
            self.calls.append((key, start, start + len(buf)))
        buf[:] = (np.arange(start, start + len(buf)) % 251).astype(np.uint8).tobytes()
        return len(buf)


def _read(ahead: ReadAhead, lo: int, hi: int) -> bytes:
    out = bytearray(hi - lo)
    with ahead.view.open_range("s", lo, hi) as f:
        assert f.read_into(lo, [memoryview(out)]) == hi - lo
    return bytes(out)


def test_fetch_buffers_are_reused_and_not_while_a_decode_thread_reads_them() -> None:
    """Stores that read into a caller's buffer get pooled buffers back from dropped blocks (a fresh buffer
    costs a page fault per page when first written); a dropped block's buffer is not reused while a decode
    thread still reads it."""
    mib = 1 << 20
    items = list(range(40))  # each item: 1 MiB of object "s"

    def ranges_of(i: int) -> list[tuple[str, int, int]]:
        return [("s", i * mib, (i + 1) * mib)]

    store = _FileRanges()
    ahead = ReadAhead(store, ReadAheadSettings(read_ahead_bytes=8 * mib, requests_in_flight=2,
                                               coalesce_gap_bytes=0, max_request_bytes=2 * mib), ranges_of)
    assert ahead.buffers is not None
    try:
        stream = ahead.wrap(iter(items))
        first = next(stream)
        held = ahead.view.open_range("s", 0, mib)  # a decode thread reading item 0's block
        ahead.done(first)  # item 0 assembled: its block dropped ...
        assert not any(ahead.buffers._free.values())  # ... but its buffer not handed to another request while it is read
        probe = bytearray(16)
        assert held.read_into(mib - 16, [memoryview(probe)]) == 16
        assert bytes(probe) == bytes((np.arange(mib - 16, mib) % 251).astype(np.uint8))
        held.close()
        for i in stream:
            lo = i * mib
            assert _read(ahead, lo, lo + mib) == bytes((np.arange(lo, lo + mib) % 251).astype(np.uint8))
            ahead.done(i)
        requests = len(store.calls)
        # 40 MiB through an 8 MiB budget: every later request reads into a buffer of an earlier one
        assert requests >= 20 and ahead.buffers.mapped <= 8 + 2, (requests, ahead.buffers.mapped)
    finally:
        ahead.close()


def test_local_read_into_fills_the_buffer_and_stops_at_the_end_of_the_file(tmp_path) -> None:
    from dflash_cache.storage import LocalStorage

    (tmp_path / "obj").write_bytes(bytes(range(200)))
    st = LocalStorage(str(tmp_path))
    buf = bytearray(64)
    assert st.read_into("obj", 100, memoryview(buf)) == 64 and bytes(buf) == bytes(range(100, 164))
    assert st.read_into("obj", 180, memoryview(buf)) == 20 and bytes(buf[:20]) == bytes(range(180, 200))


def test_a_latency_store_counts_each_read_into_as_one_request(cache_path: str) -> None:
    from dflash_cache.storage import make_storage

    latency_fs.configure(0, 0)
    latency_fs.reset_counters()
    st = make_storage(f"latency://{cache_path}")
    assert st.reads_into
    buf = bytearray(10)
    assert st.read_into("zarr.json", 0, memoryview(buf)) == 10
    assert st.get_range("zarr.json", 0, 10) == bytes(buf)
    c = latency_fs.counters()
    assert c["requests"] == 2 and c["bytes_read"] == 20, c


def test_two_requests_of_one_item_are_not_widened_over_the_same_bytes() -> None:
    """An item with two ranges of one object, too far apart to merge, gets two requests; each is widened to
    the next items' ranges, but not to those the other request already fetches (they were fetched twice:
    19% of all bytes in a one-epoch bench before this)."""
    k = 1000
    ranges = {0: [("t", 0, 10 * k)],  # (the first item is not widened: it is split over the streams)
              1: [("s", 0, 100 * k), ("s", 1950 * k, 2000 * k)],
              **{2 + i: [("s", (100 + 200 * i) * k, (300 + 200 * i) * k)] for i in range(10)}}
    store = _MemoryRanges()
    ahead = ReadAhead(store, ReadAheadSettings(read_ahead_bytes=64 << 20, requests_in_flight=4,
                                               coalesce_gap_bytes=1 << 20, max_request_bytes=2000 * k), ranges.__getitem__)
    try:
        for i in ahead.wrap(iter(sorted(ranges))):
            ahead.done(i)
    finally:
        ahead.close()
    s = sorted((a, b) for key, a, b in store.calls if key == "s")
    assert s[0][0] == 0 and s[-1][1] == 2100 * k and len(s) >= 2, s
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(s[:-1], s[1:], strict=True)), s  # no byte of "s" requested twice

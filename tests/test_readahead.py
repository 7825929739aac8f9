"""The loader's read-ahead: the same batches bitwise (and the same resume) from a modelled object store
as from local disk read in place, in a few coalesced range requests, within its memory budget."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

import dflash_cache.latency_fs as latency_fs
from dflash_cache import open_cache
from dflash_cache.readahead import coalesce
from dflash_cache.runtime.schema import LoaderConfig
from dflash_cache.synthetic import make_synthetic_cache
from train.loader import StreamingLoader

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
        shard = sorted(Path(path).glob("buckets/*/*/features/c/0/0"))[0]
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

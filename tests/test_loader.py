"""The streaming loader over real (synthetic) caches: exactly-once, bitwise resume, collation,
a slow reader, the byte cap, corrupt parts, live mode and clear errors."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_cache import create_cache, open_cache
from dflash_cache.errors import CacheCorruptError, CacheError, ConfigError
from dflash_cache.synthetic import make_synthetic_cache
from train.config import LoaderConfig
from train.data.loader import StreamingLoader
from train.data.plan import holdout_mask, plan_from_index

N = 240
BLOCKS = {"num_anchors": 512, "block_size": 16}  # train.num_anchors, model.block_size (the defaults)


@pytest.fixture(scope="module")
def cache_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("loader") / "cache")
    make_synthetic_cache(url, n_samples=N, seed=3)
    return url


def _cfg(**kw) -> LoaderConfig:
    base = {"tokens_per_batch": 1024, "num_readers": 2, "max_buffer_bytes": 1 << 24, "holdout_fraction": 0.1}
    return LoaderConfig(**{**base, **kw})


def _run(loader: StreamingLoader, epochs: int) -> list:
    out = []
    while loader.epoch < epochs:
        out.extend(loader)
    return out


def _digest(batches) -> str:
    h = hashlib.sha256()
    for b in batches:
        for t in (b.features.view(torch.int16), b.input_ids, b.loss_mask, b.doc_ids, b.position_ids, b.sample_ids):
            h.update(t.contiguous().numpy().tobytes())
        h.update(repr((b.bucket, b.epoch, b.index, b.seed, b.n_tokens, b.n_padded)).encode())
    return h.hexdigest()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_sample_once_per_epoch_across_ranks(cache_url: str, world: int) -> None:
    cache = open_cache(cache_url)
    kept = np.sort(np.arange(N)[~holdout_mask(np.arange(N), 0.1)])
    per_rank = []
    for rank in range(world):
        with StreamingLoader(cache, _cfg(), **BLOCKS, seed=1, world_size=world, rank=rank, max_epochs=2) as loader:
            per_rank.append(_run(loader, 2))
    assert len({len(r) for r in per_rank}) == 1
    for epoch in range(2):
        ids = np.concatenate([b.sample_ids.numpy() for r in per_rank for b in r if b.epoch == epoch])
        np.testing.assert_array_equal(np.sort(ids), kept)


def test_batches_hold_the_cache_samples_exactly(cache_url: str) -> None:
    cache = open_cache(cache_url)
    for packing in (False, True):
        cfg = _cfg(packing=packing, pack_row_tokens=512 if packing else None)
        with StreamingLoader(cache, cfg, **BLOCKS, seed=0, max_epochs=1) as loader:
            batches = list(loader)
        assert max(b.padding_fraction for b in batches) < 0.5
        for b in batches[:6]:
            assert b.features.dtype == torch.bfloat16 and b.features.shape[:2] == b.input_ids.shape
            assert b.num_rows * b.seq_len <= cfg.tokens_per_batch
            assert b.n_tokens == int((b.doc_ids >= 0).sum()) and b.n_padded == b.input_ids.numel() - b.n_tokens
            k = 0
            for r in range(b.num_rows):
                for d in range(int(b.doc_ids[r].max()) + 1):
                    where = torch.nonzero(b.doc_ids[r] == d).flatten()
                    s = cache.read_sample(int(b.sample_ids[k]))
                    k += 1
                    assert torch.equal(b.position_ids[r, where], torch.arange(len(where)))
                    assert torch.equal(b.input_ids[r, where], s.input_ids)
                    assert torch.equal(b.loss_mask[r, where], s.loss_mask)
                    assert torch.equal(b.features[r, where].view(torch.int16), s.features.view(torch.int16))
                pad = b.doc_ids[r] < 0
                assert not b.loss_mask[r, pad].any() and not b.features[r, pad].float().abs().sum()
            assert k == len(b.sample_ids)


def test_resume_mid_epoch_is_bitwise_and_skips_no_reads(cache_url: str) -> None:
    cache = open_cache(cache_url)
    with StreamingLoader(cache, _cfg(), **BLOCKS, seed=5, max_epochs=2) as loader:
        full = _run(loader, 2)
    n0 = sum(b.epoch == 0 for b in full)
    cut = int(np.random.default_rng().integers(1, len(full) - 1))  # a random batch, any epoch
    first = StreamingLoader(cache, _cfg(), **BLOCKS, seed=5, max_epochs=2)
    got = []
    while len(got) < cut:
        for b in first:
            got.append(b)
            if len(got) == cut:
                break
    state = first.state_dict()
    first.close()
    expected = (0, cut) if cut <= n0 else (1, cut - n0)
    assert (state["epoch"], state["next_index"]) == expected
    reads: list[list[int]] = []

    def counting_read(ids):
        reads.append(list(ids))
        return cache.read_samples(ids)

    resumed = StreamingLoader(cache, _cfg(), **BLOCKS, seed=5, max_epochs=2, read_fn=counting_read)
    resumed.load_state_dict(state)
    rest = _run(resumed, 2)
    resumed.close()
    assert _digest(got + rest) == _digest(full)
    assert len(reads) == len(full) - cut, "resume must not read the skipped batches"
    assert reads[0] == full[cut].sample_ids.tolist()


def test_resume_refuses_another_plan(cache_url: str) -> None:
    cache = open_cache(cache_url)
    with StreamingLoader(cache, _cfg(), **BLOCKS, seed=5, max_epochs=1) as loader:
        next(iter(loader))
        state = loader.state_dict()
    other = StreamingLoader(cache, _cfg(tokens_per_batch=2048), **BLOCKS, seed=5, max_epochs=1)
    other.load_state_dict(state)
    with pytest.raises(CacheError, match="differs from the checkpoint"):
        next(iter(other))
    other.close()
    with pytest.raises(ConfigError, match="seed"):
        StreamingLoader(cache, _cfg(), **BLOCKS, seed=6).load_state_dict(state)


_CHILD = """
import sys
from dflash_cache import open_cache
from tests.test_loader import BLOCKS, _cfg, _digest, _run
from train.data.loader import StreamingLoader
with StreamingLoader(open_cache(sys.argv[1]), _cfg(packing=True, num_readers=3), **BLOCKS, seed=9, max_epochs=2) as ld:
    print(_digest(_run(ld, 2)))
"""


def test_identical_batches_in_another_process(cache_url: str) -> None:
    with StreamingLoader(open_cache(cache_url), _cfg(packing=True, num_readers=1), **BLOCKS, seed=9, max_epochs=2) as ld:
        here = _digest(_run(ld, 2))
    there = subprocess.run([sys.executable, "-c", _CHILD, cache_url], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).parent.parent).stdout.strip()
    assert here == there


class _TimedReads:
    """Each read sleeps ``base_s`` (``slow_factor`` times that in reader 0) and records its span."""

    def __init__(self, cache, base_s: float, slow_factor: float):
        self.cache, self.base_s, self.slow = cache, base_s, slow_factor
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.lock = threading.Lock()

    def __call__(self, ids):
        name = threading.current_thread().name
        t0 = time.perf_counter()
        out = self.cache.read_samples(ids)
        time.sleep(self.base_s * (self.slow if name == "dflash-reader-0" else 1.0))
        with self.lock:
            self.spans.setdefault(name, []).append((t0, time.perf_counter()))
        return out


def _timed_epoch(cache, readers: int, slow: float, cap: int, epochs: int = 1
                 ) -> tuple[list[float], _TimedReads, list[int]]:
    """Run ``epochs`` epochs; returns the consumer's delivery times (from the start), reads, in-flight bytes."""
    reads = _TimedReads(cache, 0.03, slow)
    inflight, delivered = [], []
    with StreamingLoader(cache, _cfg(num_readers=readers, max_buffer_bytes=cap), **BLOCKS, seed=2, max_epochs=epochs,
                         read_fn=reads) as loader:
        t0 = time.perf_counter()
        for _ in range(epochs):
            for _ in loader:
                delivered.append(time.perf_counter() - t0)
                inflight.append(loader.last_stats.inflight_bytes)
        inflight.append(loader.counters.max_inflight_bytes)
    return delivered, reads, inflight


def test_a_slow_reader_delays_only_its_own_items(cache_url: str) -> None:
    cache = open_cache(cache_url)
    readers = 4
    base, _, _ = _timed_epoch(cache, readers, 1.0, 1 << 26, epochs=3)
    slowed, reads, _ = _timed_epoch(cache, readers, 5.0, 1 << 26, epochs=3)
    assert len(base) == len(slowed) > 40
    # ideal: the slow reader does 1/5 of a reader's work -> throughput (n - 1 + 0.2) / n of the baseline.
    # Compared at 80% of the batches: the very last item of the slow reader only delays the end.
    k = int(0.8 * len(base))
    assert base[k] / slowed[k] >= 1 - 1 / readers - 0.1, (base[k], slowed[k])
    for name, spans in reads.spans.items():
        if name == "dflash-reader-0":
            continue
        busy = sum(b - a for a, b in spans)
        last = max(b for _, b in spans) - min(a for a, _ in spans)
        assert busy / last > 0.8, f"{name} sat idle while the consumer waited on the slow reader"


def test_the_byte_cap_is_never_exceeded(cache_url: str) -> None:
    cache = open_cache(cache_url)
    cap = 1_000_000  # ~2.4 batches of this cache (a batch is at most 1024 tokens * 405 B)
    _, _, inflight = _timed_epoch(cache, 4, 5.0, cap)
    assert max(inflight) <= cap and len(inflight) > 10


def _corrupt_one_part(url: str) -> str:
    cache = open_cache(url)
    part = sorted(cache.parts(), key=lambda p: p.key)[1]
    shard = Path(url) / part.data_key / "features" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[40:80] = bytes(40)  # inside the first chunk's payload: its crc32c no longer matches
    shard.write_bytes(bytes(raw))
    return part.key


def test_corrupt_part_errors_or_is_quarantined(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    make_synthetic_cache(url, n_samples=96, seed=4)
    bad = _corrupt_one_part(url)
    cache = open_cache(url)
    idx = cache.index()
    bad_ids = set(idx.sample_ids[np.array([idx.parts[p].key == bad for p in idx.part])].tolist())
    with pytest.raises(CacheCorruptError, match=bad), StreamingLoader(cache, _cfg(holdout_fraction=0.0), **BLOCKS, seed=0) as ld:
        list(ld)
    with StreamingLoader(cache, _cfg(holdout_fraction=0.0, on_corrupt="skip"), **BLOCKS, seed=0, max_epochs=2) as loader:
        batches = _run(loader, 2)
        assert loader.counters.quarantined_parts == [bad]
        assert loader.counters.dropped_samples > 0
        assert loader.state_dict()["quarantined"] == [bad]
    for epoch in range(2):
        seen = [i for b in batches if b.epoch == epoch for i in b.sample_ids.tolist()]
        assert len(seen) == len(set(seen)), "a sample was substituted or repeated"
        assert set(seen) == set(range(96)) - bad_ids, "only the quarantined part's samples may be missing"


def test_live_mode_picks_up_a_part_committed_during_the_run(tmp_path: Path, caplog) -> None:
    url = str(tmp_path / "live")
    make_synthetic_cache(url, n_samples=40, seed=1)

    waiting = threading.Event()  # the loader has consumed every committed part and waits for more

    class _OnWaiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for new parts" in record.getMessage():
                waiting.set()

    def extract_more() -> None:
        assert waiting.wait(timeout=600), "the loader never waited for new parts"
        more = make_synthetic_cache(url, n_samples=30, seed=2, first_id=1000)
        more.write_metadata("extract_report", {"world_size": 1})  # what dflash-extract writes when done

    cfg = _cfg(live=True, live_poll_s=0.05, holdout_fraction=0.0)
    writer = threading.Thread(target=extract_more)
    caplog.set_level(logging.INFO, logger="train.data.loader")
    handler = _OnWaiting()
    logging.getLogger("train.data.loader").addHandler(handler)
    try:
        with StreamingLoader(open_cache(url), cfg, **BLOCKS, seed=0, max_epochs=2) as loader:
            writer.start()
            first = list(loader)
            second = list(loader)
            assert loader.epoch == 2
        writer.join()
    finally:
        logging.getLogger("train.data.loader").removeHandler(handler)
    expected = set(range(40)) | set(range(1000, 1030))
    ids = [i for b in first for i in b.sample_ids.tolist()]
    assert len(ids) == len(set(ids)) and set(ids) == expected
    assert [b.index for b in first] == list(range(len(first)))
    assert {i for b in second for i in b.sample_ids.tolist()} == expected
    assert any("waiting for new parts" in r.getMessage() for r in caplog.records)


def test_clear_errors(tmp_path: Path, cache_url: str) -> None:
    empty = create_cache(str(tmp_path / "empty"), open_cache(cache_url).spec)
    with pytest.raises(CacheError, match="no committed parts"):
        StreamingLoader(empty, _cfg(), **BLOCKS, seed=0)
    with pytest.raises(ConfigError, match="tokens_per_batch"):
        StreamingLoader(open_cache(cache_url), _cfg(tokens_per_batch=100), **BLOCKS, seed=0)
    with pytest.raises(ConfigError, match="agree_parts"):
        StreamingLoader(open_cache(cache_url), _cfg(live=True), **BLOCKS, seed=0, world_size=2)


@pytest.mark.parametrize("packing", [False, True])
def test_decoding_into_batches_equals_collating_read_samples(cache_url: str, packing: bool) -> None:
    cache = open_cache(cache_url)
    cfg = _cfg(packing=packing, pack_row_tokens=512 if packing else None)
    with StreamingLoader(cache, cfg, **BLOCKS, seed=4, max_epochs=2) as direct:
        a = _digest(_run(direct, 2))
    with StreamingLoader(cache, cfg, **BLOCKS, seed=4, max_epochs=2, read_fn=cache.read_samples) as collated:
        b = _digest(_run(collated, 2))
    assert a == b


def test_batch_buffers_are_reused_only_once_released(cache_url: str) -> None:
    cache = open_cache(cache_url)
    with StreamingLoader(cache, _cfg(num_readers=1), **BLOCKS, seed=6, max_epochs=1) as loader:
        on_arrival = [_digest([b]) for b in loader]  # each batch dropped before the next is taken
        assert loader._pool.reused > 0
    with StreamingLoader(cache, _cfg(num_readers=1), **BLOCKS, seed=6, max_epochs=1) as loader:
        kept = list(loader)  # every batch held: no buffer may be refilled under them
        assert loader._pool.reused == 0
    assert [_digest([b]) for b in kept] == on_arrival


def test_buffer_pool_waits_for_views_and_device_copies() -> None:
    from train.data.batch import BatchBufferPool

    class Event:
        done = False

        def query(self) -> bool:
            return self.done

    pool = BatchBufferPool(slot_bytes=4096, max_slots=1)
    t = pool.batch_tensors(2, 8, 16)
    ptr = t["features"].data_ptr()
    view = t["loss_mask"][1:]
    del t
    assert pool.batch_tensors(2, 8, 16)["features"].data_ptr() != ptr  # a view is alive: fresh memory
    del view
    t = pool.batch_tensors(2, 8, 16)
    assert t["features"].data_ptr() == ptr and pool.reused == 1
    event = Event()
    pool.record_copy(t["features"], event)
    del t
    assert pool.batch_tensors(2, 8, 16)["features"].data_ptr() != ptr  # the device copy is still running
    event.done = True
    assert pool.batch_tensors(2, 8, 16)["features"].data_ptr() == ptr
    assert pool.take(8192).numel() == 8192  # larger than a slot: unpooled memory


def test_each_epoch_is_planned_once_and_counted_plans_are_read(cache_url: str, monkeypatch) -> None:
    from train.data import plan as plan_mod

    calls = []
    real = plan_mod.Planner.plan
    monkeypatch.setattr(plan_mod.Planner, "plan", lambda self, epoch, **kw: calls.append(epoch) or real(self, epoch, **kw))
    cache = open_cache(cache_url)
    with StreamingLoader(cache, _cfg(), **BLOCKS, seed=3, max_epochs=3) as loader:
        lengths = loader.epoch_lengths(3)
        batches = _run(loader, 3)
    assert calls == [0, 1, 2], "every epoch's plan is built once: the counted plans are the ones read"
    assert [sum(b.epoch == e for b in batches) for e in range(3)] == lengths
    estimate = plan_from_index(cache.index(), _cfg(), seed=3, epoch=1, **BLOCKS)  # what `estimate` plans
    assert [cache.index().sample_ids[b.positions].tolist() for b in estimate.batches] == \
        [b.sample_ids.tolist() for b in batches if b.epoch == 1]


def test_the_block_budget_bounds_the_objective_blocks(cache_url: str) -> None:
    from train.models.objective import FlatBatch, sample_anchors

    anchors, block = 8, 16
    budget = 5 * (anchors * block)  # at most 5 documents of >= 9 tokens per batch; 1024 tokens would hold ~10
    cache = open_cache(cache_url)
    with StreamingLoader(cache, _cfg(max_block_positions=budget), seed=1, num_anchors=anchors, block_size=block,
                         max_epochs=1) as loader:
        batches = list(loader)
    with StreamingLoader(cache, _cfg(), seed=1, num_anchors=anchors, block_size=block, max_epochs=1) as free:
        assert len(list(free)) < len(batches)
    kept = np.sort(np.arange(N)[~holdout_mask(np.arange(N), 0.1)])
    np.testing.assert_array_equal(np.sort(np.concatenate([b.sample_ids.numpy() for b in batches])), kept)
    for b in batches:
        flat = FlatBatch.of(b)
        drawn = sample_anchors(flat.eligible, flat.docs, anchors, torch.Generator().manual_seed(b.seed))
        lengths = (b.doc_ids.unsqueeze(-1) == torch.arange(int(b.doc_ids.max()) + 1)).sum(1)  # [R, D]
        bound = int((torch.clamp(lengths[lengths > 0] - 1, max=anchors) * block).sum())
        assert len(drawn) * block <= bound <= budget

"""The streaming loader: plan-ordered batches from the cache, prefetched by a pool of readers.

Readers take work items (planned batches) from ONE shared sequence in plan order, read and
collate them, and put them into a reorder buffer capped in bytes; the consumer takes them
strictly in order. A reader claims the next item only when its bytes fit under the cap, so
the cap holds for everything claimed and not yet consumed (reads in flight included). A
slow read delays only its own item: the other readers keep claiming the items after it.
(The cap is exceeded only by a single batch larger than the whole cap, which is then read
alone.)

Position = (epoch, batch index) plus the parts the current plan window was built from.
``load_state_dict`` rebuilds that plan from the index and starts at the saved index: the
skipped batches are neither read nor replayed, and the batches that follow are bitwise the
ones the uninterrupted loader would have produced (outside live mode, and unless a corrupt
part was quarantined: which batches lose that part's samples depends on read timing).

Live mode (``loader.live``) follows a cache that is still being extracted: each epoch starts
with a plan window over the parts committed at that moment; when the readers have claimed
every batch of it they poll ``cache.parts()`` and plan the newly committed parts as the next
window of the same epoch (batch indices continue). With nothing new they wait, logging a
status line, until new parts come, the extraction is marked finished (``extraction_done``),
or ``loader.live_timeout_s`` passes without a new part; then the epoch ends.

With ``world_size > 1`` in live mode every rank must plan the same windows: pass
``agree_parts`` (for example rank 0's list broadcast with ``torch.distributed``).

Readers decode each sample's features straight into its place in the batch tensor (no per-sample
tensors, no second copy), and batches live in reusable host buffers (pinned with a GPU): a buffer is
refilled only after every tensor of the batch it held is gone and its device copy has completed.
With a ``read_fn`` the samples it returns are collated into those buffers instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from dflash_cache.errors import CacheCorruptError, CacheError, ConfigError
from dflash_cache.reader import PartReaderCache
from dflash_cache.schema import LoaderConfig

from .batch import Batch, BatchBufferPool, carve_batch, host_buffer, padded_nbytes
from .plan import EpochPlan, PlannedBatch, PlanSettings, build_plan

log = logging.getLogger(__name__)

STATE_VERSION = 1
_PIECE_CHUNKS = 2  # a decode task: features of at most this many (aligned) inner chunks of a sample
# bytes per token slot besides the features: input_ids int64 + loss_mask bool + doc_ids int32 + position_ids int64
_SLOT_BYTES = 8 + 1 + 4 + 8


class SampleLike(Protocol):
    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    features: torch.Tensor  # bf16 [T, n*H]


ReadFn = Callable[[Sequence[int]], Sequence[SampleLike]]


@dataclass
class BatchStats:
    """What the consumer saw when it took one batch."""

    epoch: int
    index: int
    bucket: int
    data_wait_s: float  # time the consumer waited for this batch
    queue_items: int  # batches ready in the buffer after taking this one
    queue_bytes: int  # bytes of those ready batches
    inflight_bytes: int  # bytes claimed by readers and not yet consumed (<= max_buffer_bytes)
    padding_fraction: float
    n_tokens: int
    sample_ids: np.ndarray  # int64 [S]
    n_dropped: int = 0  # samples left out because their part is quarantined


@dataclass
class LoaderCounters:
    batches: int = 0
    tokens: int = 0
    data_wait_s: float = 0.0
    quarantined_parts: list[str] = field(default_factory=list)
    dropped_samples: int = 0
    empty_batches: int = 0  # batches whose every sample was in a quarantined part (not delivered)
    live_waits: int = 0
    max_inflight_bytes: int = 0


@dataclass
class _Window:
    """One plan window: the batches planned over a fixed set of parts."""

    epoch: int
    number: int
    parts: list[str]
    plan: EpochPlan
    sample_ids: np.ndarray  # int64 [N] arrays the plan's positions index
    part_keys: np.ndarray  # object [N]: each sample's part key
    lengths: np.ndarray  # int32 [N] tokens
    part_index: np.ndarray  # int32 [N] into part_infos
    rows: np.ndarray  # int32 [N] position within its part
    part_infos: list[Any]  # PartInfo of the index the window was planned from
    first_index: int
    history: list[list[str]]  # parts of windows 0..number of this epoch


@dataclass
class _Item:
    window: _Window
    planned: PlannedBatch
    nbytes: int


class _Prefetcher:
    """Fixed reader pool over one ordered work stream, a byte-capped reorder buffer, in-order get()."""

    def __init__(self, work: Callable[[threading.Event], Iterator[_Item]], produce: Callable[[_Item], Any],
                 num_readers: int, max_bytes: int):
        self._stop = threading.Event()
        self._work, self._produce, self._max_bytes = work(self._stop), produce, max_bytes
        self._work_lock = threading.Lock()
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[_Item | None, Any, BaseException | None, int]] = {}
        self._next_claim = self._next_deliver = 0
        self._reserved = self._ready_bytes = 0
        self.max_reserved = 0
        self._exhausted = False
        self._threads = [threading.Thread(target=self._run, name=f"dflash-reader-{k}", daemon=True)
                         for k in range(num_readers)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            claimed = self._claim()
            if claimed is None:
                return
            seq, item = claimed
            result, err = None, None
            try:
                result = self._produce(item)
            except BaseException as e:  # delivered to the consumer in order
                err = e
            with self._cond:
                self._ready[seq] = (item, result, err, item.nbytes)
                self._ready_bytes += item.nbytes
                self._cond.notify_all()

    def _claim(self) -> tuple[int, _Item] | None:
        with self._work_lock:  # holders claim in plan order; the others wait their turn
            if self._exhausted:
                return None
            try:
                item = next(self._work, None)
            except BaseException as e:
                self._finish(e)
                return None
            if item is None:
                self._finish(None)
                return None
            with self._cond:
                while (self._reserved and self._reserved + item.nbytes > self._max_bytes
                       and not self._stop.is_set()):
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return None
                seq = self._next_claim
                self._next_claim += 1
                self._reserved += item.nbytes
                self.max_reserved = max(self.max_reserved, self._reserved)
            return seq, item

    def _finish(self, err: BaseException | None) -> None:
        with self._cond:
            if err is not None:
                self._ready[self._next_claim] = (None, None, err, 0)
                self._next_claim += 1
            self._exhausted = True
            self._cond.notify_all()

    def get(self) -> tuple[_Item | None, Any, float, int, int, int]:
        """(item, result, wait_s, ready items, ready bytes, reserved bytes); item None: stream ended."""
        t0 = time.perf_counter()
        with self._cond:
            while self._next_deliver not in self._ready:
                if self._exhausted and self._next_deliver >= self._next_claim:
                    return None, None, time.perf_counter() - t0, 0, 0, 0
                self._cond.wait(0.5)
            item, result, err, nbytes = self._ready.pop(self._next_deliver)
            self._next_deliver += 1
            self._reserved -= nbytes
            self._ready_bytes -= nbytes
            inflight = self._reserved
            self._cond.notify_all()
            depth, ready_bytes = len(self._ready), self._ready_bytes
        if err is not None:
            self.close()
            raise err
        return item, result, time.perf_counter() - t0, depth, ready_bytes, inflight

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)


def _batch_nbytes(planned: PlannedBatch, feature_dim: int) -> int:
    slots = planned.num_rows * planned.seq_len
    return slots * (feature_dim * 2 + _SLOT_BYTES) + len(planned.positions) * 8


Alloc = Callable[[int, int], dict[str, torch.Tensor]]  # (rows, seq_len) -> uninitialised batch tensors


def _fresh(feature_dim: int, pin: bool) -> Alloc:
    return lambda rows, seq_len: carve_batch(host_buffer(padded_nbytes(rows, seq_len, feature_dim), pin), rows,
                                              seq_len, feature_dim)


def _init_padding(t: dict[str, torch.Tensor]) -> None:
    """Padding values everywhere but the features (whose padding is zeroed row by row)."""
    t["input_ids"].zero_()
    t["loss_mask"].zero_()
    t["doc_ids"].fill_(-1)
    t["position_ids"].zero_()


def collate(rows: Sequence[Sequence[SampleLike]], feature_dim: int, pin: bool = False,
            alloc: Alloc | None = None) -> dict[str, torch.Tensor]:
    """Rows of documents -> padded tensors (documents back to back within a row). ``alloc`` gives the
    (uninitialised) tensors, e.g. from a :class:`~train.batch.BatchBufferPool`."""
    R = len(rows)
    T = max(sum(int(s.input_ids.shape[0]) for s in row) for row in rows)
    t = (alloc or _fresh(feature_dim, pin))(R, T)  # features [R, T, n*H], the rest [R, T]
    _init_padding(t)
    features = t["features"]
    ramp = torch.arange(T, dtype=torch.int64)
    for r, row in enumerate(rows):
        off = 0
        for d, s in enumerate(row):
            n = int(s.input_ids.shape[0])
            features[r, off:off + n] = s.features
            t["input_ids"][r, off:off + n] = s.input_ids
            t["loss_mask"][r, off:off + n] = s.loss_mask
            t["doc_ids"][r, off:off + n] = d
            t["position_ids"][r, off:off + n] = ramp[:n]
            off += n
        features[r, off:] = 0
    return t


def extraction_finished(cache: Any) -> bool:
    """True once ``dflash-extract`` has finished writing ``cache``: its rank 0 writes the
    ``extract_report`` metadata document after every rank's last commit."""
    try:
        cache.read_metadata("extract_report")
    except CacheError:
        return False
    return True


class StreamingLoader:
    """Iterate it once per epoch: ``for batch in loader`` yields the rest of the current epoch.

    ``read_fn`` replaces ``cache.read_samples`` (tests inject slow or failing reads with it)."""

    def __init__(
        self,
        cache: Any,
        cfg: LoaderConfig,
        *,
        seed: int,
        world_size: int = 1,
        rank: int = 0,
        device: torch.device | str | None = None,
        max_epochs: int | None = None,
        read_fn: ReadFn | None = None,
        extraction_done: Callable[[], bool] | None = None,
        agree_parts: Callable[[list[str]], list[str]] | None = None,
    ):
        self.cache, self.cfg = cache, cfg
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else None
        self.max_epochs = max_epochs
        self._read = read_fn or cache.read_samples
        # decode straight into batch buffers unless reads are injected (or the cache has no byte storage)
        storage = getattr(cache, "storage", None)
        self._readers = PartReaderCache(storage, capacity=256) if read_fn is None and storage is not None else None
        self._decoders = None  # threads that decode pieces of batches (blosc runs without the GIL)
        if self._readers is not None and cfg.num_readers > 1:
            self._decoders = concurrent.futures.ThreadPoolExecutor(cfg.num_readers, thread_name_prefix="dflash-decode")
        self._extraction_done = extraction_done or (lambda: extraction_finished(cache))
        self._agree = agree_parts or (lambda keys: keys)
        if cfg.live and world_size > 1 and agree_parts is None:
            raise ConfigError("loader.live with several ranks needs agree_parts, so that every rank plans the "
                              "same windows (e.g. broadcast rank 0's part list); or set loader.live = false")
        self.settings = PlanSettings(seed=seed, world_size=world_size, tokens_per_batch=cfg.tokens_per_batch,
                                     packing=cfg.packing, row_tokens=cfg.pack_row_tokens,
                                     sort_window=cfg.sort_window, holdout_fraction=cfg.holdout_fraction)
        self.feature_dim = int(cache.spec.feature_dim)
        self._pin = bool(cfg.pin_memory and self.device is not None and self.device.type == "cuda")
        self._copy_stream = torch.cuda.Stream(self.device) if self._pin else None
        slot_tokens = max(cfg.tokens_per_batch, cfg.pack_row_tokens or 0)
        slot_bytes = padded_nbytes(1, slot_tokens, self.feature_dim)
        self._pool = BatchBufferPool(slot_bytes, max_slots=cfg.max_buffer_bytes // slot_bytes + cfg.num_readers + 2,
                                     pin=self._pin)
        self.counters = LoaderCounters()
        self.last_stats: BatchStats | None = None
        self.status = "idle"
        self._quarantine: set[str] = set()
        self._quarantine_lock = threading.Lock()
        self._static_parts: list[str] | None = None if cfg.live else self._committed_keys(require=True)
        self._epoch, self._next_index = 0, 0
        self._windows: list[list[str]] = []  # parts of each window of the current epoch so far
        self._index: Any = None
        self._window_identity: str | None = None
        self._prefetcher: _Prefetcher | None = None
        self._pending: tuple[_Item, Any, float, int, int, int] | None = None
        if self._static_parts is not None:  # fail here, not in a reader thread, on an unusable plan
            self._window(0, 0, self._static_parts, 0)

    # ---------------------------------------------------------------- public API

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._epoch
        while True:
            got = self._take()
            if got is None:
                self._end_epoch(epoch)
                return
            item, result, wait, depth, ready_bytes, inflight = got
            if item.window.epoch != epoch:
                self._pending = got
                self._end_epoch(epoch)
                return
            batch = self._account(item, result, wait, depth, ready_bytes, inflight)
            if batch is not None:
                yield batch

    def epoch_lengths(self, epochs: int) -> list[int]:
        """Batches per epoch on this rank for ``epochs`` epochs (for lr schedules; not in live mode)."""
        if self.cfg.live:
            raise ConfigError("epoch lengths are unknown in live mode: the cache is still growing; "
                              "schedule by train.max_steps instead")
        return [len(self._window(e, 0, self._static_parts or [], 0).plan) for e in range(epochs)]

    def _index_with(self, parts: list[str]) -> Any:
        """The cache index, re-read only when it lacks one of ``parts`` (live mode)."""
        idx = self._index
        if idx is None or not set(parts) - self._quarantine <= {p.key for p in idx.parts}:
            idx = self._index = self.cache.index(skip_corrupt=self.cfg.on_corrupt == "skip")
            for err in idx.skipped:  # unreadable small arrays or commit record: quarantined, not fatal
                self._quarantine_part(err)
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "epoch": self._epoch, "next_index": self._next_index,
            "windows": [list(w) for w in self._windows], "window_identity": self._window_identity,
            "quarantined": sorted(self._quarantine), "seed": self.settings.seed,
            "world_size": self.world_size, "rank": self.rank, "static_parts": self._static_parts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"loader state version {state.get('version')} is not {STATE_VERSION}; "
                              "this checkpoint was written by another version of dflash-train")
        for key, mine in (("seed", self.settings.seed), ("world_size", self.world_size), ("rank", self.rank)):
            if state[key] != mine:
                raise ConfigError(f"the checkpoint's loader ran with {key}={state[key]}, this run has {mine}; "
                                  f"resume with the same {key} (or start a new run)")
        self._shutdown()
        self._epoch, self._next_index = int(state["epoch"]), int(state["next_index"])
        self._windows = [list(w) for w in state["windows"]]
        self._window_identity = state["window_identity"]
        self._quarantine = set(state["quarantined"])
        self.counters.quarantined_parts = sorted(self._quarantine)
        if not self.cfg.live:
            self._static_parts = list(state["static_parts"])
        self.last_stats = None

    def close(self) -> None:
        self._shutdown()
        self._pool.clear()
        if self._decoders is not None:
            self._decoders.shutdown(wait=True)
            self._decoders = None

    def __enter__(self) -> StreamingLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- planning

    def _committed_keys(self, require: bool) -> list[str]:
        if self.cfg.on_corrupt == "skip":
            parts, bad = self.cache.scan_parts()
            for err in bad:  # a commit record that cannot be trusted: quarantined, not fatal
                self._quarantine_part(err)
        else:
            parts = self.cache.parts()
        keys = sorted(p.key for p in parts)
        if require and not keys:
            raise CacheError(f"the cache at {self.cache.url} has no committed parts; run dflash-extract first, "
                             "or set loader.live = true to wait for parts being extracted")
        return keys

    def _window(self, epoch: int, number: int, parts: list[str], first_index: int,
                history: list[list[str]] | None = None) -> _Window:
        idx = self._index_with(parts)
        keys = np.array([p.key for p in idx.parts], dtype=object)
        missing = sorted(set(parts) - set(keys.tolist()) - self._quarantine)
        if missing:
            raise CacheError(f"parts {missing[:3]} planned for epoch {epoch} are no longer committed in "
                             f"{self.cache.url}; restore them or start a new run")
        part_keys = keys[idx.part] if len(idx) else np.zeros(0, dtype=object)
        sel = np.isin(part_keys, np.array(parts, dtype=object)) if len(parts) else np.zeros(len(idx), bool)
        ids, lengths, buckets = idx.sample_ids[sel], idx.lengths[sel], idx.buckets[sel]
        plan = build_plan(ids, lengths, buckets, self.settings, epoch=epoch, rank=self.rank, window=number,
                          first_index=first_index)
        return _Window(epoch, number, list(parts), plan, ids, part_keys[sel], lengths, idx.part[sel], idx.row[sel],
                       list(idx.parts), first_index, history or [list(parts)])

    def _work(self, epoch: int, saved: list[list[str]], next_index: int, identity: str | None,
              stop: threading.Event) -> Iterator[_Item]:
        """The work stream from (epoch, next_index) on, across windows and epochs."""
        windows = [list(w) for w in saved]
        while self.max_epochs is None or epoch < self.max_epochs:
            first = 0
            for number in range(10**9):
                if number < len(windows):
                    parts: list[str] | None = windows[number]
                else:
                    parts = self._next_window_parts(epoch, windows, stop)
                    if parts is None:
                        break
                    windows.append(parts)
                win = self._window(epoch, number, parts, first, [list(w) for w in windows])
                if identity is not None and number == len(saved) - 1:
                    self._check_identity(win, identity)
                    identity = None
                for b in win.plan.batches:
                    if b.index >= next_index:
                        yield _Item(win, b, _batch_nbytes(b, self.feature_dim))
                first += len(win.plan)
                if not self.cfg.live:
                    break
            epoch, windows, next_index = epoch + 1, [], 0

    def _check_identity(self, win: _Window, identity: str) -> None:
        if win.plan.identity != identity:
            raise CacheError(
                f"the plan for epoch {win.epoch} (window {win.number}) differs from the checkpoint's: the cache "
                "index, the seed or the loader settings changed since the checkpoint; resume with the same "
                "cache and loader config, or start a new run")

    def _next_window_parts(self, epoch: int, windows: list[list[str]], stop: threading.Event) -> list[str] | None:
        if not self.cfg.live:
            return self._static_parts if not windows else None
        seen = {k for w in windows for k in w}
        waited_since, last_log = time.monotonic(), 0.0
        while True:
            new = self._agree([k for k in self._committed_keys(require=False) if k not in seen])
            if new:
                self.status = "reading"
                return sorted(new)
            if self._extraction_done():
                if windows:
                    return None
                raise CacheError(f"the cache at {self.cache.url} has no committed parts and its extraction is "
                                 "marked finished; nothing to train on")
            idle = time.monotonic() - waited_since
            if self.cfg.live_timeout_s is not None and idle >= self.cfg.live_timeout_s:
                log.warning("live: no new part for %.0f s (loader.live_timeout_s); ending epoch %d with %d parts",
                            idle, epoch, len(seen))
                return None
            self.status = f"waiting for new parts ({len(seen)} planned, extraction running)"
            if time.monotonic() - last_log >= max(30.0, self.cfg.live_poll_s) or last_log == 0.0:
                log.info("live: consumed everything committed so far; %s, waited %.0f s", self.status, idle)
                last_log = time.monotonic()
                self.counters.live_waits += 1
            if stop.wait(self.cfg.live_poll_s):
                return None

    # ---------------------------------------------------------------- reading

    def _produce(self, item: _Item) -> tuple[Batch | None, int]:
        planned, win = item.planned, item.window
        rows = [[int(p) for p in r] for r in planned.rows()]
        dropped = 0
        while True:
            with self._quarantine_lock:
                bad = set(self._quarantine)
            if bad:
                kept = [[p for p in r if win.part_keys[p] not in bad] for r in rows]
                dropped += sum(len(r) for r in rows) - sum(len(r) for r in kept)
                rows = [r for r in kept if r]
            if not rows:
                return None, dropped
            try:
                return self._read_batch(item, rows), dropped
            except CacheCorruptError as err:
                if self.cfg.on_corrupt == "error" or err.part is None:
                    raise
                self._quarantine_part(err)

    def _quarantine_part(self, err: CacheCorruptError) -> None:
        with self._quarantine_lock:
            if err.part in self._quarantine:
                return
            self._quarantine.add(err.part)  # type: ignore[arg-type]
            self.counters.quarantined_parts = sorted(self._quarantine)
        log.warning("quarantined part %s for the rest of the run (loader.on_corrupt = skip; %d part(s) so far): %s",
                    err.part, len(self._quarantine), err)

    def _read_batch(self, item: _Item, rows: list[list[int]]) -> Batch:
        win, planned = item.window, item.planned
        ids = win.sample_ids[[p for r in rows for p in r]]
        if self._readers is None:
            samples = self._read(ids.tolist())
            it = iter(samples)
            t = collate([[next(it) for _ in r] for r in rows], self.feature_dim, alloc=self._alloc)
        else:
            t = self._decode_batch(win, rows)
        n_tokens = int(t["doc_ids"].ge(0).sum())
        return Batch(**t, sample_ids=torch.from_numpy(ids.astype(np.int64)), bucket=planned.bucket,
                     epoch=win.epoch, index=planned.index, n_tokens=n_tokens,
                     n_padded=t["input_ids"].numel() - n_tokens, seed=planned.seed)

    def _alloc(self, rows: int, seq_len: int) -> dict[str, torch.Tensor]:
        return self._pool.batch_tensors(rows, seq_len, self.feature_dim)

    def _decode_batch(self, win: _Window, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """Each document decoded straight into its place in the (pooled) batch tensors; the features in
        pieces of a few chunks, spread over the decode threads (so that even one batch in flight keeps
        every reader busy)."""
        assert self._readers is not None
        seq_len = max(int(win.lengths[r].sum()) for r in rows)
        t = self._alloc(len(rows), seq_len)  # features [R, T, n*H], the rest [R, T]
        _init_padding(t)
        features = t["features"]
        pieces = []
        for r, row in enumerate(rows):
            off = 0
            for d, p in enumerate(row):
                reader = self._readers.get(win.part_infos[int(win.part_index[p])])
                a, b = reader.span(int(win.rows[p]))
                n = b - a
                t["input_ids"][r, off:off + n] = torch.from_numpy(reader.small("input_ids")[a:b])
                t["loss_mask"][r, off:off + n] = torch.from_numpy(reader.small("loss_mask")[a:b])
                t["doc_ids"][r, off:off + n] = d
                t["position_ids"][r, off:off + n] = torch.arange(n, dtype=torch.int64)
                step = _PIECE_CHUNKS * reader.part.chunk_tokens if self._decoders is not None else b
                cuts = [a, *range((a // step + 1) * step, b, step), b]  # chunk-aligned inner cuts
                for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                    pieces.append((reader, lo, hi, features[r, off + lo - a:off + hi - a]))
                off += n
            features[r, off:] = 0
        self._decode_pieces(pieces)
        return t

    def _decode_pieces(self, pieces: list[tuple[Any, int, int, torch.Tensor]]) -> None:
        if self._decoders is None or len(pieces) == 1:
            for reader, lo, hi, dest in pieces:
                reader.read_tokens_into(lo, hi, dest)
            return
        futures = [self._decoders.submit(reader.read_tokens_into, lo, hi, dest) for reader, lo, hi, dest in pieces]
        concurrent.futures.wait(futures)  # every piece done (or failed) before the buffer can be dropped
        for f in futures:
            f.result()  # the first failure, in batch order

    # ---------------------------------------------------------------- consuming

    def _ensure_started(self) -> None:
        if self._prefetcher is None:
            epoch, windows, index, identity = self._epoch, self._windows, self._next_index, self._window_identity
            self._prefetcher = _Prefetcher(lambda stop: self._work(epoch, windows, index, identity, stop),
                                           self._produce, self.cfg.num_readers, self.cfg.max_buffer_bytes)

    def _take(self) -> tuple[_Item, Any, float, int, int, int] | None:
        if self._pending is not None:
            got, self._pending = self._pending, None
            return got
        self._ensure_started()
        assert self._prefetcher is not None
        item, result, wait, depth, ready_bytes, inflight = self._prefetcher.get()
        self.counters.max_inflight_bytes = self._prefetcher.max_reserved
        return None if item is None else (item, result, wait, depth, ready_bytes, inflight)

    def _account(self, item: _Item, result: tuple[Batch | None, int], wait: float, depth: int,
                 ready_bytes: int, inflight: int) -> Batch | None:
        batch, dropped = result
        win = item.window
        self._next_index = item.planned.index + 1
        self._windows = win.history
        self._window_identity = win.plan.identity
        self.counters.data_wait_s += wait
        self.counters.dropped_samples += dropped
        if batch is None:
            self.counters.empty_batches += 1
            log.warning("epoch %d batch %d: every sample is in a quarantined part; batch skipped",
                        win.epoch, item.planned.index)
            return None
        self.counters.batches += 1
        self.counters.tokens += batch.n_tokens
        self.last_stats = BatchStats(epoch=batch.epoch, index=batch.index, bucket=batch.bucket, data_wait_s=wait,
                                     queue_items=depth, queue_bytes=ready_bytes, inflight_bytes=inflight,
                                     padding_fraction=batch.padding_fraction, n_tokens=batch.n_tokens,
                                     sample_ids=batch.sample_ids.numpy(), n_dropped=dropped)
        return self._to_device(batch)

    def _to_device(self, batch: Batch) -> Batch:
        if self.device is None or self.device.type == "cpu":
            return batch
        if self._copy_stream is None:
            return batch.to(self.device, non_blocking=False)
        with torch.cuda.stream(self._copy_stream):  # the copy runs off the compute stream
            moved = batch.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._pool.record_copy(batch.features, done)  # its host buffer is refilled only after the copy
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self._copy_stream)
        for name in ("features", "input_ids", "loss_mask", "doc_ids", "position_ids", "sample_ids"):
            getattr(moved, name).record_stream(compute)
        return moved

    def _end_epoch(self, epoch: int) -> None:
        self._epoch, self._next_index, self._windows, self._window_identity = epoch + 1, 0, [], None
        if self._pending is None and self._prefetcher is not None:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self._pending = None

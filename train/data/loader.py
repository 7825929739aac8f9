"""The streaming loader: plan-ordered batches from the cache, prefetched by a pool of readers.

The loader owns the *position* in the data and where batches go; the two jobs under it live in
their own modules: :mod:`train.data.prefetch` (a fixed reader pool over one ordered work stream, with a
byte-capped reorder buffer) and :mod:`train.data.assemble` (planned rows of samples decoded from their
cache parts into one padded batch in reusable host buffers).

Position = (epoch, batch index) plus the parts the current plan window was built from.
``load_state_dict`` rebuilds that plan from the index and starts at the saved index: the
skipped batches are neither read nor replayed, and the batches that follow are bitwise the
ones the uninterrupted loader would have produced (outside live mode, and unless a corrupt
part was quarantined: which batches lose that part's samples depends on read timing).

Each plan window is built once: the samples of its parts are selected by integer part number
(O(samples)), and the plans that :meth:`StreamingLoader.epoch_lengths` builds to count batches
are kept (columnar, ~10 bytes per sample) and consumed when their epoch is read.

Live mode (``loader.live``) follows a cache that is still being extracted: each epoch starts
with a plan window over the parts committed at that moment; when the readers have claimed
every batch of it, :class:`train.data.live.LiveWindows` polls for newly committed parts and they
are planned as the next window of the same epoch (batch indices continue), or the epoch ends.
With ``world_size > 1`` every rank must plan the same windows: pass ``agree_parts`` (the trainer
passes :meth:`~dflash_cache.runtime.dist.Distributed.decided_by_main`).

Corrupt parts (``loader.on_corrupt``): with "error" the first corrupt read stops the run; with
"skip" the part is quarantined for the rest of the run (:class:`train.data.quarantine.Quarantine`),
its samples are left out of every later batch and counted, and the quarantine is part of the state.

Batches land on ``device``: with a GPU, from pinned host buffers, copied on a side stream; a
host buffer is refilled only after every tensor of the batch it held is gone and its copy is done.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from dflash_cache.errors import CacheCorruptError, CacheError, ConfigError
from dflash_cache.protocols import ReadableCache
from dflash_cache.readahead import ReadAhead, ReadAheadSettings, ReadCounters
from train.config import LoaderConfig

from .assemble import BatchAssembler, ReadFn, SampleTable, batch_nbytes
from .batch import Batch, BatchBufferPool, padded_nbytes
from .live import Agree, LiveWindows, extraction_finished
from .plan import EpochPlan, PlannedBatch, Planner, PlanSettings, holdout_mask
from .prefetch import Delivery, Prefetcher
from .quarantine import Quarantine

log = logging.getLogger(__name__)

STATE_VERSION = 1


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
    table: SampleTable  # the samples the plan's positions index
    history: list[list[str]]  # parts of windows 0..number of this epoch


@dataclass(frozen=True)
class _Item:
    """A work item of the reader pool: one planned batch of a window."""

    window: _Window
    planned: PlannedBatch
    nbytes: int


class _Produced(NamedTuple):
    batch: Batch | None  # None: every sample of the batch was in a quarantined part
    dropped: int  # samples left out because their part is quarantined


def locality_units(table: SampleTable, run_samples: int | None) -> np.ndarray:
    """The unit ``loader.locality_parts`` groups, per sample: its part, or (``run_samples``) its run of that
    many consecutive samples within its part."""
    part = np.asarray(table.part, dtype=np.int64)
    if run_samples is None:
        return part
    runs_per_part = int(np.asarray(table.row).max(initial=0)) // run_samples + 1
    return part * runs_per_part + np.asarray(table.row, dtype=np.int64) // run_samples


def select_parts(index: Any, parts: list[str], url: str = "the cache") -> SampleTable:
    """The samples of ``index`` (a :class:`~dflash_cache.index.CacheIndex`) in ``parts`` (part keys), selected
    by part number: O(samples). Every part selected: views of the index arrays, no copy."""
    number = {p.key: i for i, p in enumerate(index.parts)}
    missing = sorted(k for k in set(parts) if k not in number)
    if missing:
        raise CacheError(f"parts {missing[:3]} planned for this run are no longer committed in {url}; "
                         "restore them or start a new run")
    if len(set(parts)) == len(index.parts):
        sel: Any = slice(None)
    else:
        wanted = np.zeros(len(index.parts), dtype=bool)
        wanted[[number[k] for k in parts]] = True
        sel = np.flatnonzero(wanted[index.part])
    return SampleTable(index.sample_ids[sel], index.lengths[sel], index.buckets[sel], index.part[sel],
                       index.row[sel], list(index.parts))


class StreamingLoader:
    """Iterate it once per epoch: ``for batch in loader`` yields the rest of the current epoch.

    ``num_anchors`` (train.num_anchors) and ``block_size`` (model.block_size) size the plan's
    block-position budget (``loader.max_block_positions``).
    ``read_fn`` replaces ``cache.read_samples`` (tests inject slow or failing reads with it)."""

    def __init__(
        self,
        cache: ReadableCache,
        cfg: LoaderConfig,
        *,
        seed: int,
        num_anchors: int,
        block_size: int,
        world_size: int = 1,
        rank: int = 0,
        device: torch.device | str | None = None,
        max_epochs: int | None = None,
        read_fn: ReadFn | None = None,
        extraction_done: Callable[[], bool] | None = None,
        agree_parts: Agree | None = None,
    ):
        self.cache, self.cfg = cache, cfg
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else None
        self.max_epochs = max_epochs
        self.counters = LoaderCounters()
        self._quarantine = Quarantine(cfg.on_corrupt, on_change=self._quarantine_changed, logger=log)
        self._live = None if not cfg.live else LiveWindows(
            cfg, cache.url, world_size, committed_keys=lambda: self._committed_keys(require=False),
            training_samples=self._training_samples,
            extraction_done=extraction_done or (lambda: extraction_finished(cache)), agree=agree_parts,
            on_wait=self._live_waited, logger=log)
        self.settings = PlanSettings.from_config(cfg, seed=seed, num_anchors=num_anchors, block_size=block_size,
                                                 world_size=world_size)
        self.feature_dim = int(cache.spec.feature_dim)
        self._pin = bool(cfg.pin_memory and self.device is not None and self.device.type == "cuda")
        self._copy_stream = torch.cuda.Stream(self.device) if self._pin else None
        slot_tokens = max(cfg.tokens_per_batch, cfg.pack_row_tokens or 0)
        slot_bytes = padded_nbytes(1, slot_tokens, self.feature_dim)
        self._pool = BatchBufferPool(slot_bytes, max_slots=cfg.max_buffer_bytes // slot_bytes + cfg.num_readers + 2,
                                     pin=self._pin)
        self.read_counters = ReadCounters()
        self._read_ahead = self._build_read_ahead(cache, cfg, read_fn)
        self._assembler = BatchAssembler(cache, self._pool, self.feature_dim, cfg.num_readers, read_fn,
                                         storage=self._read_ahead.view if self._read_ahead is not None else None)
        self.last_stats: BatchStats | None = None
        self._epoch, self._next_index = 0, 0
        self._windows: list[list[str]] = []  # parts of each window of the current epoch so far
        self._index: Any = None
        self._planner: tuple[tuple[str, ...], SampleTable, Planner] | None = None  # of the latest parts planned
        self._plans: dict[tuple[int, int, int, tuple[str, ...]], EpochPlan] = {}  # built ahead, read once
        self._plans_lock = threading.Lock()
        self._window_identity: str | None = None
        self._prefetcher: Prefetcher[_Item] | None = None
        self._pending: Delivery[_Item] | None = None
        self._static_parts: list[str] | None = None if cfg.live else self._committed_keys(require=True)
        if self._static_parts is not None:  # fail here, not in a reader thread, on an unusable plan
            self._window(0, 0, self._static_parts, 0, keep=True)

    # ---------------------------------------------------------------- public API

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def status(self) -> str:
        """What the loader is doing: "idle", or in live mode "reading" / "waiting for new parts (...)"."""
        return self._live.status if self._live is not None else "idle"

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._epoch
        while True:
            got = self._take()
            if got is None:
                self._end_epoch(epoch)
                return
            if got.item.window.epoch != epoch:
                self._pending = got
                self._end_epoch(epoch)
                return
            batch = self._account(got)
            if batch is not None:
                yield batch

    def epoch_lengths(self, epochs: int) -> list[int]:
        """Batches per epoch on this rank for ``epochs`` epochs (for lr schedules; not in live mode).
        The plans built to count them are kept and read when their epoch comes."""
        if self.cfg.live:
            raise ConfigError("epoch lengths are unknown in live mode: the cache is still growing; "
                              "schedule by train.max_steps instead")
        return [len(self._window(e, 0, self._static_parts or [], 0, keep=True).plan) for e in range(epochs)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "epoch": self._epoch, "next_index": self._next_index,
            "windows": [list(w) for w in self._windows], "window_identity": self._window_identity,
            "quarantined": self._quarantine.state_dict(), "seed": self.settings.seed,
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
        self._quarantine.load_state_dict(state["quarantined"])
        if not self.cfg.live:
            self._static_parts = list(state["static_parts"])
        self.last_stats = None

    def close(self) -> None:
        self._shutdown()
        self._pool.clear()
        self._assembler.close()
        if self._read_ahead is not None:
            self._read_ahead.close()

    def __enter__(self) -> StreamingLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- planning

    def _committed_keys(self, require: bool) -> list[str]:
        if self.cfg.on_corrupt == "skip":
            parts, bad = self.cache.scan_parts()
            for err in bad:  # a commit record that cannot be trusted: quarantined, not fatal
                self._quarantine.add(err)
        else:
            parts = self.cache.parts()
        keys = sorted(p.key for p in parts)
        if require and not keys:
            raise CacheError(f"the cache at {self.cache.url} has no committed parts; run dflash-extract first, "
                             "or set loader.live = true to wait for parts being extracted")
        return keys

    def _index_with(self, parts: list[str]) -> Any:
        """The cache index, re-read only when it lacks one of ``parts`` (live mode)."""
        idx = self._index
        if idx is None or not set(parts) - set(self._quarantine.keys()) <= {p.key for p in idx.parts}:
            idx = self._index = self.cache.index(skip_corrupt=self.cfg.on_corrupt == "skip")
            for err in idx.skipped:  # unreadable small arrays or commit record: quarantined, not fatal
                self._quarantine.add(err)
        return idx

    def _table(self, parts: list[str]) -> tuple[SampleTable, Planner]:
        """The samples of ``parts`` and their planner; the latest is kept (outside live mode every epoch
        plans the same parts)."""
        key = tuple(parts)
        got = self._planner
        if got is not None and got[0] == key:
            return got[1], got[2]
        index = self._index_with(parts)
        # a part quarantined since it was planned (unreadable small arrays) is left out, not "missing"
        table = select_parts(index, [p for p in parts if p not in self._quarantine], self.cache.url)
        planner = Planner(table.sample_ids, table.lengths, table.buckets, self.settings,
                          parts=locality_units(table, self.cfg.locality_run_samples))
        self._planner = (key, table, planner)
        return table, planner

    def _window(self, epoch: int, number: int, parts: list[str], first_index: int,
                history: list[list[str]] | None = None, keep: bool = False) -> _Window:
        """The window's plan: taken from the plans built ahead if there (``keep``: leave it there for later)."""
        table, planner = self._table(parts)
        key = (epoch, number, first_index, tuple(parts))
        with self._plans_lock:
            plan = self._plans.get(key) if keep else self._plans.pop(key, None)
            if not keep:  # plans of epochs before this one will not be read (a resumed run)
                for k in [k for k in self._plans if k[0] < epoch]:
                    del self._plans[k]
        if plan is None:
            plan = planner.plan(epoch, rank=self.rank, window=number, first_index=first_index)
            if keep:
                with self._plans_lock:
                    self._plans[key] = plan
        return _Window(epoch, number, list(parts), plan, table, history or [list(parts)])

    def _work(self, epoch: int, saved: list[list[str]], next_index: int, identity: str | None,
              stop: threading.Event) -> Iterator[_Item]:
        """The work stream from (epoch, next_index) on, across windows and epochs."""
        windows = [list(w) for w in saved]
        while self.max_epochs is None or epoch < self.max_epochs:
            first = 0
            for number in itertools.count():
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
                for k in range(max(0, next_index - first), len(win.plan)):
                    b = win.plan.batch(k)
                    yield _Item(win, b, batch_nbytes(b.num_rows, b.seq_len, len(b.positions), self.feature_dim))
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
        if self._live is None:
            return self._static_parts if not windows else None
        return self._live.next_window(epoch, windows, stop)

    def _training_samples(self, parts: list[str]) -> int:
        """Samples of ``parts`` a plan would train on (held-out ones left out)."""
        ids = select_parts(self._index_with(parts), parts, self.cache.url).sample_ids
        if self.settings.holdout_fraction > 0:
            ids = ids[~holdout_mask(np.asarray(ids, dtype=np.int64), self.settings.holdout_fraction)]
        return len(ids)

    # ---------------------------------------------------------------- reading (in the reader threads)

    def _build_read_ahead(self, cache: ReadableCache, cfg: LoaderConfig, read_fn: ReadFn | None) -> ReadAhead | None:
        """loader.read_ahead: on for object stores (``auto``), never with injected reads or a live cache
        (whose work stream waits for new parts at window ends: items must not be held back for it)."""
        storage = getattr(cache, "storage", None)
        if read_fn is not None or storage is None or cfg.live or cfg.read_ahead == "off":
            return None
        if cfg.read_ahead == "auto" and storage.is_local:
            return None
        settings = ReadAheadSettings(cfg.read_ahead_bytes, cfg.requests_in_flight, cfg.coalesce_gap_bytes,
                                     cfg.max_request_bytes)
        return ReadAhead(storage, settings, self._item_ranges, self.read_counters, prepare=self._prepare_ranges)

    def _item_ranges(self, item: _Item) -> list[tuple[str, int, int]]:
        """The feature byte ranges of one planned batch (from the parts' offsets and shard indexes)."""
        table, out = item.window.table, []
        for p in (int(p) for r in item.planned.rows() for p in r):
            try:
                reader = self._assembler.reader(table.parts[int(table.part[p])])
                out += reader.feature_ranges(*reader.span(int(table.row[p])))
            except (CacheCorruptError, FileNotFoundError):
                pass  # a damaged part is reported (or quarantined) by the read itself
        return out

    def _prepare_ranges(self, items: list[_Item]) -> None:
        """Metadata of several planned batches read in parallel (offsets, shard indexes: then cached)."""
        assert self._read_ahead is not None
        self._read_ahead.map(self._item_ranges, items)

    def _produce(self, item: _Item) -> _Produced:
        """Assemble one planned batch, leaving out the samples of quarantined parts (loader.on_corrupt)."""
        try:
            return self._produce_batch(item)
        finally:
            if self._read_ahead is not None:
                self._read_ahead.done(item)

    def _produce_batch(self, item: _Item) -> _Produced:
        planned, win = item.planned, item.window
        rows = [[int(p) for p in r] for r in planned.rows()]
        dropped = 0
        while True:
            rows, n = self._quarantine.drop(win.table, rows)
            dropped += n
            if not rows:
                return _Produced(None, dropped)
            try:
                batch = self._assembler.assemble(win.table, rows, bucket=planned.bucket, epoch=win.epoch,
                                                 index=planned.index, seed=planned.seed)
                return _Produced(batch, dropped)
            except CacheCorruptError as err:
                if not self._quarantine.skip or err.part is None:
                    raise
                self._quarantine.add(err)

    def _quarantine_changed(self, keys: list[str]) -> None:
        self.counters.quarantined_parts = keys

    def _live_waited(self) -> None:
        self.counters.live_waits += 1

    # ---------------------------------------------------------------- consuming

    def _ensure_started(self) -> None:
        if self._prefetcher is None:
            epoch, windows, index, identity = self._epoch, self._windows, self._next_index, self._window_identity
            ahead = self._read_ahead
            self._prefetcher = Prefetcher(
                lambda stop: (ahead.wrap if ahead is not None else iter)(self._work(epoch, windows, index, identity,
                                                                                     stop)),
                                          self._produce, self.cfg.num_readers, self.cfg.max_buffer_bytes)

    def _take(self) -> Delivery[_Item] | None:
        if self._pending is not None:
            got, self._pending = self._pending, None
            return got
        self._ensure_started()
        assert self._prefetcher is not None
        got = self._prefetcher.get()
        self.counters.max_inflight_bytes = self._prefetcher.max_reserved
        return got

    def _account(self, got: Delivery[_Item]) -> Batch | None:
        batch, dropped = got.result
        item, win = got.item, got.item.window
        self._next_index = item.planned.index + 1
        self._windows = win.history
        self._window_identity = win.plan.identity
        self.counters.data_wait_s += got.wait_s
        self.counters.dropped_samples += dropped
        if batch is None:
            self.counters.empty_batches += 1
            log.warning("epoch %d batch %d: every sample is in a quarantined part; batch skipped",
                        win.epoch, item.planned.index)
            return None
        self.counters.batches += 1
        self.counters.tokens += batch.n_tokens
        self.last_stats = BatchStats(epoch=batch.epoch, index=batch.index, bucket=batch.bucket,
                                     data_wait_s=got.wait_s, queue_items=got.ready_items,
                                     queue_bytes=got.ready_bytes, inflight_bytes=got.inflight_bytes,
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
            if self._read_ahead is not None:
                self._read_ahead.reset()
        self._pending = None

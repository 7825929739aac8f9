"""The extraction loop behind ``dflash-extract CONFIG --out CACHE`` (:mod:`extract.run`): teacher features
for every sample, written once into the cache.

Work units are contiguous ranges of ``extract.unit_size`` sample ids; process ``rank`` of ``world``
takes units ``u % world == rank``. A unit writes one part per length bucket, named ``u<unit>``, with
``{"unit", "unit_parts", "unit_buckets", "unit_stats"}`` in its meta: a unit is done when all its
parts are committed, so a rerun skips it, and the partial units of a killed run are recomputed with
the same batches (bitwise identical output, whatever the number of processes).

Several jobs on one ``--out`` (a requeued job starting while the old one still runs) share the
work: before running a unit a process leases every uncommitted part of it
(:mod:`dflash_cache.lease`); a unit with a part leased by a live writer is put aside and retried
after the others, so every job ends with the whole dataset. At the end each process re-checks every
unit it counts against the commit records and exits 2 unless all of them are complete.

Before the cache is created every record is tokenized once (unless ``--skip-bad``), so a data
error is reported while the data can still be fixed and rerun into a fresh cache.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_cache.errors import CacheError, DataError
from dflash_cache.lease import LEASE_TIMEOUT_S, Holder, LeaseHeldError, PartCommittedError, PartLease, acquire
from dflash_cache.parts import part_key
from dflash_cache.protocols import WritableCache
from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.schema import PipelineConfig
from dflash_cache.runtime.threads import budget_cpu_threads

from .batching import Batch, collate, plan_batches
from .config import ExtractConfig
from .data import ReadCounts, Record, data_fingerprint, iter_records
from .output import build_spec, check_units, complete_units, open_output, storage_errors
from .progress import ExtractProgress, human_bytes
from .run_config import sample_rules
from .teacher import (
    capture_features,
    capture_features_and_argmax,
    capture_features_and_final,
    load_teacher,
    num_decoder_layers,
    resolve_layer_ids,
    teacher_device,
)
from .template import (
    SampleRules,
    TokenizedSample,
    TokenizeStats,
    check_chat_template,
)
from .writing import BackgroundWriter, RowJob

log = logging.getLogger(__name__)

WAIT_POLL_S = 2.0  # how often units leased by other processes are looked at again
_WAIT_LOG_S = 60.0


@dataclass
class ExtractReport:
    """What one ``dflash-extract`` run did (summed over ranks)."""

    units_total: int = 0
    units_skipped: int = 0  # already complete in the cache
    units_by_others: int = 0  # completed by another process while this one ran
    units_complete: int = 0  # re-checked at the end against the commit records
    units_incomplete: int = 0
    samples_in_cache: int = 0  # committed samples of the units re-checked
    samples_written: int = 0
    tokens_written: int = 0
    parts_committed: int = 0
    bytes_written: int = 0
    n_truncated: int = 0
    n_too_few_loss: int = 0
    n_bad: int = 0
    n_bad_files: int = 0  # whole data files that could not be read (skipped with --skip-bad)
    n_nonfinite: int = 0
    tokens_real: int = 0
    tokens_computed: int = 0
    forward_s: float = 0.0
    stall_s: float = 0.0
    loop_s: float = 0.0  # the unit loop until the last part is committed (no loading/setup)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens_real / self.tokens_computed if self.tokens_computed else 0.0

    def counts(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items() if isinstance(v, int | float)}

    def lines(self) -> list[str]:
        read = self.extra.get("read")
        return [read.summary()] * (read is not None) + [
            f"units: {self.units_total} ({self.units_skipped} already complete, {self.units_by_others} completed by "
            "another process meanwhile)",
            f"cache: {self.samples_in_cache} samples in {self.units_complete} complete units (re-checked against the "
            "commit records)",
            f"written: {self.samples_written} samples, {self.tokens_written} tokens, {self.parts_committed} parts, "
            f"{human_bytes(self.bytes_written)}",
            f"skipped: {self.n_bad} bad records, {self.n_bad_files} unreadable files, {self.n_too_few_loss} with too "
            "few loss tokens, "
            f"{self.n_nonfinite} non-finite; truncated to max_length: {self.n_truncated}",
            f"padding: {self.padding_fraction:.2%} of {self.tokens_computed} computed tokens",
            f"time: {self.wall_s:.1f} s wall, {self.forward_s:.1f} s teacher forward, {self.stall_s:.1f} s waiting "
            "on the writer",
        ]



# -- the per-unit loop ---------------------------------------------------------------------------------


@dataclass
class PreparedUnit:
    """A tokenized work unit, ready to be leased and run."""

    unit: int
    samples: list[TokenizedSample]
    stats: TokenizeStats
    buckets: dict[int, int]  # sample id -> bucket
    meta: dict[str, Any]
    n_records: int  # input records of the unit (kept samples + dropped ones): its share of the progress bar

    @property
    def part(self) -> str:
        return f"u{self.unit:07d}"

    @property
    def unit_buckets(self) -> list[int]:
        return list(self.meta["unit_buckets"])


def check_records(rules: SampleRules, tokenizer: Any, vocab: int, records: Iterable[Record]) -> None:
    """Tokenize every record once (one at a time, nothing kept) and refuse the lot when any is bad, listing the
    first few."""
    t0 = time.perf_counter()
    stats = TokenizeStats()
    for _ in rules.iter(records, tokenizer, stats, vocab, skip_bad=True):
        pass
    n = stats.n_samples + stats.n_too_few_loss + stats.n_bad
    log.info("checked %d records in %.1f s before creating the cache", n, time.perf_counter() - t0)
    if stats.n_bad:
        shown = "\n  ".join(stats.bad_examples[:5])
        raise DataError(f"{stats.n_bad} of {n} records cannot be tokenized (checked before creating the "
                        f"cache); the first {min(stats.n_bad, 5)}:\n  {shown}\nFix them, or pass --skip-bad to skip "
                        "such records (they are counted)")


class UnitRunner:
    """Tokenizes, leases, batches, runs the teacher on and writes one work unit at a time."""

    def __init__(self, extract_cfg: ExtractConfig, rules: SampleRules, store_target_argmax: bool, model: Any,
                 tokenizer: Any, cache: WritableCache, layer_ids: list[int], writer: BackgroundWriter,
                 progress: ExtractProgress, report: ExtractReport):
        self.extract_cfg, self.rules, self.store_target_argmax = extract_cfg, rules, store_target_argmax
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.layer_ids, self.writer, self.progress, self.report = layer_ids, writer, progress, report
        self.store_final_hidden = bool(cache.spec.final_hidden)  # the cache's spec says what a part holds
        self.rank, self.world = 0, 1
        self.device = teacher_device(model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.vocab = int(model.get_input_embeddings().weight.shape[0])
        self.empty_units: set[int] = set()  # units that kept no sample (nothing to write)
        self.holders: dict[int, Holder] = {}  # units put aside: who holds them

    def tokenize(self, records: list[Record]) -> tuple[list[TokenizedSample], TokenizeStats]:
        return self.rules.prepare(records, self.tokenizer, self.vocab)

    def prepare(self, unit: int, records: list[Record]) -> PreparedUnit:
        samples, stats = self.tokenize(records)
        buckets = {s.sample_id: self.cache.bucket_of(s.length) for s in samples}
        unit_buckets = sorted(set(buckets.values()))
        meta = {"unit": unit, "unit_parts": len(unit_buckets), "unit_buckets": unit_buckets,
                "unit_size": self.extract_cfg.unit_size, "unit_stats": stats.as_dict(), "rank": self.rank,
                "world_size": self.world}
        return PreparedUnit(unit, samples, stats, buckets, meta, len(records))

    def try_run(self, prep: PreparedUnit) -> bool:
        """Lease the unit's uncommitted parts and run it; False (nothing done) when a live process holds
        one of them: try again later."""
        if not prep.unit_buckets:
            self.empty_units.add(prep.unit)
            self._count(prep)
            return True
        leases: dict[int, PartLease] = {}
        committed: set[int] = set()
        try:
            with storage_errors(self.cache.url, f"leasing the parts of unit {prep.unit}"):
                for b in prep.unit_buckets:
                    try:
                        leases[b] = acquire(self.cache.storage, part_key(b, prep.part),
                                            self.extract_cfg.lease_timeout_s or LEASE_TIMEOUT_S)
                    except PartCommittedError:
                        committed.add(b)
        except LeaseHeldError as err:
            for lease in leases.values():
                lease.release(remove_dir=True)
            if prep.unit not in self.holders:
                log.debug("unit %d is being written by %s: put aside", prep.unit, err.holder.describe())
            self.holders[prep.unit] = err.holder
            return False
        except BaseException:
            for lease in leases.values():
                lease.release(remove_dir=True)
            raise
        self.holders.pop(prep.unit, None)
        if not leases:  # another process completed it meanwhile
            self.report.units_by_others += 1
            self.progress.add(samples=prep.n_records)
            return True
        self._count(prep)
        self.progress.add(samples=prep.n_records - len(prep.samples))  # dropped records are done too
        self.run_unit(prep, leases, committed)
        return True

    def _count(self, prep: PreparedUnit) -> None:
        self.report.n_truncated += prep.stats.n_truncated
        self.report.n_too_few_loss += prep.stats.n_too_few_loss
        self.report.n_bad += prep.stats.n_bad

    def run_unit(self, prep: PreparedUnit, leases: dict[int, PartLease], done_buckets: set[int]) -> None:
        for b, lease in leases.items():
            self.writer.adopt(b, prep.part, lease)
        x = self.extract_cfg
        for group in plan_batches(prep.samples, x.tokens_per_batch, x.max_batch_size, x.batch_overhead):
            todo = [s for s in group if prep.buckets[s.sample_id] not in done_buckets]
            if todo:  # batches are planned over the whole unit so a partial redo computes identical features
                self.run_batch(collate(group, self.pad_id), prep.buckets, done_buckets, prep.part, prep.meta)
            self.progress.add(samples=len(group))
            self.progress.refresh()
        for b in prep.unit_buckets:
            if b not in done_buckets:
                self.writer.submit_commit(b, prep.part, prep.meta)

    def run_batch(self, batch: Batch, buckets: dict[int, int], done: set[int], part: str, meta: dict) -> None:
        ids = batch.input_ids.to(self.device, non_blocking=True)  # [B, T]
        mask = batch.attention_mask.to(self.device, non_blocking=True)  # [B, T]
        t0 = time.perf_counter()
        if self.store_final_hidden:  # [B, T, (n+1)*H]: the layers, then the final normed state
            feats, argmax = capture_features_and_final(self.model, ids, mask, self.layer_ids, self.store_target_argmax)
        elif self.store_target_argmax:
            feats, argmax = capture_features_and_argmax(self.model, ids, mask, self.layer_ids)
        else:
            feats, argmax = capture_features(self.model, ids, mask, self.layer_ids)[0], None
        host, host_argmax, ready = to_host(feats, argmax)  # [B, T, n*H]
        if ready is None:
            self.report.forward_s += time.perf_counter() - t0
        rows = [RowJob(i, s.sample_id, s.input_ids, s.loss_mask, buckets[s.sample_id], part, meta)
                for i, s in enumerate(batch.samples) if buckets[s.sample_id] not in done]
        self.writer.submit_rows(host, host_argmax, ready, rows)
        if ready is not None:
            self.report.forward_s += time.perf_counter() - t0
        self.report.tokens_real += batch.n_real
        self.report.tokens_computed += batch.n_computed
        self.progress.add(tokens=batch.n_real)

def to_host(feats: torch.Tensor, argmax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Start the device->host copy (bf16, pinned, async) and return ``(host, argmax, ready_event)``."""
    if feats.device.type != "cuda":
        return feats, argmax, None  # the writer converts to bf16, off the compute thread
    feats = feats.to(torch.bfloat16)
    host = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
    host.copy_(feats, non_blocking=True)
    host_argmax = None
    if argmax is not None:
        host_argmax = torch.empty(argmax.shape, dtype=argmax.dtype, pin_memory=True)
        host_argmax.copy_(argmax, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, host_argmax, ready


@dataclass
class DataScan:
    """One streaming pass over the input: how many records (the unit count follows), how many good ones each
    unit holds (the progress total), and what reading counted (bad records by reason)."""

    n_total: int
    per_unit: Counter[int]
    counts: ReadCounts
    conversations: bool  # any record to template (else all are pre-tokenized)


def scan_data(path: str, skip_bad: bool, unit_size: int) -> DataScan:
    counts = ReadCounts()
    per_unit: Counter[int] = Counter()
    conversations = False
    for r in iter_records(path, skip_bad, counts):
        per_unit[r.sample_id // unit_size] += 1
        conversations = conversations or not r.pretokenized
    return DataScan(counts.n_total, per_unit, counts, conversations)


def unit_records(records: Iterable[Record], unit_size: int, n_units: int) -> Iterator[tuple[int, list[Record]]]:
    """``(unit, its records)`` for every unit ``0 .. n_units-1`` in order (an empty list for a unit whose records
    were all bad), from records in sample-id order: one unit in memory at a time."""
    it = iter(records)
    pending = next(it, None)
    for u in range(n_units):
        recs = []
        while pending is not None and pending.sample_id // unit_size == u:
            recs.append(pending)
            pending = next(it, None)
        yield u, recs


def run_extraction(cfg: PipelineConfig, out_url: str, progress: bool = True) -> ExtractReport:
    """Extract teacher features for every sample of ``cfg.data`` into the cache at ``out_url``."""
    t_start = time.perf_counter()
    ctx = Distributed.start()
    budget_cpu_threads(ctx.device, 0, ctx.local_world_size)  # compute-bound: the writers need no reserved core
    log.info("extraction: %s", ctx.describe())  # a collective: every rank calls it
    try:
        return _run(cfg, out_url, ctx, progress, t_start)
    finally:
        ctx.close()


def _run(cfg: PipelineConfig, out_url: str, ctx: Distributed, show: bool, t_start: float) -> ExtractReport:
    # The data is streamed, never held: one pass counts it (units, progress total, bad records), an optional
    # one checks it before the cache exists, and the unit loop reads it again one unit at a time.
    unit_size = cfg.extract.unit_size
    scan = scan_data(cfg.data.path, cfg.data.skip_bad, unit_size)
    model, tokenizer = load_teacher(cfg.teacher)
    if scan.conversations:
        check_chat_template(tokenizer)
    layer_ids = resolve_layer_ids(cfg.cache, num_decoder_layers(model))
    n_units = -(-scan.n_total // unit_size)
    own = [u for u in range(n_units) if u % ctx.world_size == ctx.rank]
    vocab = int(model.get_input_embeddings().weight.shape[0])

    def own_records() -> Iterator[Record]:
        return (r for r in iter_records(cfg.data.path, warn=False) if (r.sample_id // unit_size) % ctx.world_size
                == ctx.rank)

    check = None if cfg.data.skip_bad else lambda: check_records(sample_rules(cfg), tokenizer, vocab, own_records())
    spec = build_spec(cfg, model, tokenizer, layer_ids, data_fingerprint(cfg.data.path))
    cache = open_output(ctx, out_url, spec, cfg, model, check)
    complete = complete_units(cache)
    mine = [u for u in own if u not in complete]
    todo_total = sum(n for u, n in scan.per_unit.items() if u not in complete)
    report = ExtractReport(units_total=n_units, units_skipped=len(complete),
                           n_bad=len(scan.counts.bad) if ctx.rank == 0 else 0,
                           n_bad_files=len(scan.counts.bad_files) if ctx.rank == 0 else 0)
    report.extra["read"] = scan.counts
    log.info("rank %d/%d: %d of %d units to extract (%d already complete)", ctx.rank, ctx.world_size, len(mine),
             n_units, len(complete))
    bar = ExtractProgress(ctx, todo_total, enabled=show)
    writer = BackgroundWriter(cache, cfg.extract.writer_threads, cfg.extract.max_inflight_bytes,
                              cfg.extract.on_nonfinite, on_commit=lambda info: bar.add(
                                  committed_samples=info.n_samples,
                                  bytes=sum(int(a.get("stored_bytes", 0)) for a in info.arrays.values())))
    runner = UnitRunner(cfg.extract, sample_rules(cfg), cfg.cache.store_target_argmax, model, tokenizer, cache,
                        layer_ids, writer, bar, report)
    runner.rank, runner.world = ctx.rank, ctx.world_size
    t_loop = time.perf_counter()
    try:
        deferred = {}
        todo = set(mine)
        again = ReadCounts()
        for u, recs in unit_records(iter_records(cfg.data.path, cfg.data.skip_bad, again, warn=False), unit_size,
                                    n_units):
            if u in todo:
                prep = runner.prepare(u, recs)
                if not runner.try_run(prep):
                    deferred[u] = prep
        if again.n_total != scan.n_total:
            raise DataError(f"{cfg.data.path}: changed while being read ({scan.n_total} records, then "
                            f"{again.n_total}); keep the input fixed during extraction and rerun")
        wait_for_others(runner, deferred)
        stats = writer.close()
        report.loop_s = time.perf_counter() - t_loop
        bar.finish()  # rank 0 draws until every rank is done: the bar ends at the job's total
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    report.samples_written, report.tokens_written = stats.n_samples, stats.n_tokens
    report.parts_committed, report.bytes_written = stats.n_parts, stats.bytes_written
    report.n_nonfinite, report.stall_s = stats.n_nonfinite, stats.stall_s
    report.units_complete, report.samples_in_cache, problems = check_units(
        cache, own, runner.empty_units)
    report.units_incomplete = len(problems)
    for line in problems[:20]:
        log.error("incomplete after the run: %s", line)
    report.wall_s = time.perf_counter() - t_start
    return _finish(ctx, cache, report)


def wait_for_others(runner: UnitRunner, deferred: dict[int, PreparedUnit]) -> None:
    """Retry the units put aside (leased by other live processes) until each is committed by its
    holder or, when a holder dies, by this process."""
    if deferred:
        holders = sorted({h.who for h in runner.holders.values()})
        log.info("%d unit(s) were being written by other processes (%s) when this one reached them; waiting for "
                 "them (a unit whose writer dies is taken over)", len(deferred), ", ".join(holders[:5]))
    last_log = time.monotonic()
    while deferred:
        runner.writer.raise_if_failed()
        time.sleep(WAIT_POLL_S)
        for u in list(deferred):
            if runner.try_run(deferred[u]):
                del deferred[u]
        if deferred and time.monotonic() - last_log > _WAIT_LOG_S:
            last_log = time.monotonic()
            held = ", ".join(f"{u} ({runner.holders[u].describe()})" for u in list(deferred)[:5] if u in runner.holders)
            log.info("waiting for %d unit(s) being written by other processes: %s", len(deferred), held)


def _finish(ctx: Distributed, cache: WritableCache, report: ExtractReport) -> ExtractReport:
    own_wall, own_fwd, own_loop = report.wall_s, report.forward_s, report.loop_s
    total = ctx.sum_counts(report.counts())
    for k, v in total.items():
        setattr(report, k, type(getattr(report, k))(v))
    report.units_total, report.units_skipped = int(total["units_total"] / ctx.world_size), int(
        total["units_skipped"] / ctx.world_size)
    report.wall_s, report.forward_s, report.loop_s = own_wall, own_fwd, own_loop  # per-process, not sums
    if report.units_incomplete:
        raise CacheError(f"{report.units_incomplete} work unit(s) are not complete in {cache.url} after this run "
                         f"({report.units_complete} are; the log names them); rerun the same command to finish them")
    if ctx.rank == 0:
        with storage_errors(cache.url, "writing the extraction report"):
            cache.write_metadata("extract_report", {**report.counts(), "padding_fraction": report.padding_fraction,
                                                    "world_size": ctx.world_size})
    ctx.barrier()
    return report

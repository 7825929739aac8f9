"""``dflash-extract CONFIG --out CACHE``: teacher features for every sample, written once into the cache.

Work units are contiguous ranges of ``extract.unit_size`` sample ids; process ``rank`` of ``world``
takes units ``u % world == rank``. A unit writes one part per length bucket, named ``u<unit>``, with
``{"unit", "unit_parts"}`` in its meta: a unit is done when all its parts are committed, so a rerun
skips it, and the partial units of a killed run are recomputed with the same batches (bitwise
identical output, whatever the number of processes).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_cache import CacheSpec, TeacherInfo, create_cache, open_cache
from dflash_cache.errors import CacheError, ConfigError
from dflash_cache.runtime.config import config_to_dict, load_config
from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.log import process_rank
from dflash_cache.runtime.schema import PipelineConfig
from dflash_cache.runtime.threads import budget_cpu_threads

from .batching import Batch, collate, plan_batches
from .data import Record, load_records
from .progress import ExtractProgress, human_bytes
from .teacher import (
    capture_features,
    capture_features_and_argmax,
    load_teacher,
    num_decoder_layers,
    resolve_layer_ids,
    resolve_mask_token,
    teacher_device,
    teacher_name,
)
from .template import (
    TemplateOptions,
    TokenizedSample,
    TokenizeStats,
    check_chat_template,
    prepare_samples,
    tokenizer_hash,
)
from .writing import BackgroundWriter, RowJob

log = logging.getLogger(__name__)


@dataclass
class ExtractReport:
    """What one ``dflash-extract`` run did (summed over ranks)."""

    units_total: int = 0
    units_skipped: int = 0  # already complete in the cache
    samples_written: int = 0
    tokens_written: int = 0
    parts_committed: int = 0
    bytes_written: int = 0
    n_truncated: int = 0
    n_too_few_loss: int = 0
    n_bad: int = 0
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
        return [
            f"units: {self.units_total} ({self.units_skipped} already complete)",
            f"written: {self.samples_written} samples, {self.tokens_written} tokens, {self.parts_committed} parts, "
            f"{human_bytes(self.bytes_written)}",
            f"skipped: {self.n_bad} bad records, {self.n_too_few_loss} with too few loss tokens, "
            f"{self.n_nonfinite} non-finite; truncated to max_length: {self.n_truncated}",
            f"padding: {self.padding_fraction:.2%} of {self.tokens_computed} computed tokens",
            f"time: {self.wall_s:.1f} s wall, {self.forward_s:.1f} s teacher forward, {self.stall_s:.1f} s waiting "
            "on the writer",
        ]


# -- assembly ------------------------------------------------------------------------------------------


def min_loss_tokens(cfg: PipelineConfig) -> int:
    return cfg.data.min_loss_tokens or 2 * cfg.model.block_size


def template_options(cfg: PipelineConfig) -> TemplateOptions:
    return TemplateOptions(cfg.data.system_prompt, cfg.data.enable_thinking)


def build_spec(cfg: PipelineConfig, model: Any, tokenizer: Any, layer_ids: list[int], dataset_fp: str) -> CacheSpec:
    text = model.config.get_text_config()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    teacher = TeacherInfo(
        name_or_path=teacher_name(cfg.teacher), revision=cfg.teacher.revision,
        num_layers=num_decoder_layers(model), hidden_size=int(text.hidden_size),
        vocab_size=vocab, dtype=cfg.teacher.dtype,
    )
    mask_id, mask_source = resolve_mask_token(cfg.model.mask_token_id, tokenizer, vocab)
    return CacheSpec(
        teacher=teacher, target_layer_ids=layer_ids, tokenizer_hash=tokenizer_hash(tokenizer, template_options(cfg)),
        max_length=cfg.data.max_length, codec=cfg.cache.codec, bucket_edges=cfg.cache.bucket_edges,
        dataset_fingerprint=dataset_fp, mask_token_id=mask_id, mask_token_source=mask_source,
    )


def save_head(cache: Any, model: Any) -> None:
    embed = model.get_input_embeddings().weight.detach().cpu()  # [V, H]
    head = model.get_output_embeddings().weight.detach().cpu()  # [V, H]
    tied = head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    cache.save_head(embed, None if tied else head)


def open_output(ctx: Distributed, url: str, spec: CacheSpec, cfg: PipelineConfig, model: Any) -> Any:
    """Rank 0 creates (or re-opens) the cache, clears leftovers, writes metadata and the head."""
    cache = None
    if ctx.rank == 0:
        cache = create_cache(url, spec, chunk_tokens=cfg.cache.chunk_tokens, shard_tokens=cfg.cache.shard_tokens)
        removed = cache.gc()
        if removed:
            log.info("discarded %d uncommitted part(s) of an earlier run", len(removed))
        cache.write_metadata("config", config_to_dict(cfg))
        if not cache.has_head():
            save_head(cache, model)
    ctx.barrier()
    if cache is None:
        cache = open_cache(url)
        if cache.spec.fingerprint != spec.fingerprint:
            raise CacheError(f"{url}: the cache spec changed under this process; rerun all ranks together")
    return cache


def committed_units(cache: Any) -> dict[int, set[int]]:
    """``unit -> committed buckets`` for units with every part committed (complete) or some (partial)."""
    out: dict[int, set[int]] = {}
    for p in cache.parts():
        if "unit" in p.meta:
            out.setdefault(int(p.meta["unit"]), set()).add(p.bucket)
    return out


def complete_units(cache: Any) -> set[int]:
    expected: dict[int, int] = {}
    for p in cache.parts():
        if "unit" in p.meta:
            expected[int(p.meta["unit"])] = int(p.meta["unit_parts"])
    done = committed_units(cache)
    return {u for u, n in expected.items() if len(done[u]) == n}


# -- the per-unit loop ---------------------------------------------------------------------------------


class UnitRunner:
    """Tokenizes, batches, runs the teacher on and writes one work unit at a time."""

    def __init__(self, cfg: PipelineConfig, model: Any, tokenizer: Any, cache: Any, layer_ids: list[int],
                 writer: BackgroundWriter, progress: ExtractProgress, report: ExtractReport):
        self.cfg, self.model, self.tokenizer, self.cache = cfg, model, tokenizer, cache
        self.layer_ids, self.writer, self.progress, self.report = layer_ids, writer, progress, report
        self.rank, self.world = 0, 1
        self.device = teacher_device(model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.vocab = int(model.get_input_embeddings().weight.shape[0])

    def tokenize(self, records: list[Record]) -> tuple[list[TokenizedSample], TokenizeStats]:
        d = self.cfg.data
        return prepare_samples(records, self.tokenizer, template_options(self.cfg), d.max_length,
                               min_loss_tokens(self.cfg), skip_bad=d.skip_bad, vocab_size=self.vocab)

    def run_unit(self, unit: int, records: list[Record], done_buckets: set[int]) -> None:
        samples, stats = self.tokenize(records)
        self.report.n_truncated += stats.n_truncated
        self.report.n_too_few_loss += stats.n_too_few_loss
        self.report.n_bad += stats.n_bad
        buckets = {s.sample_id: self.cache.bucket_of(s.length) for s in samples}
        unit_buckets = sorted(set(buckets.values()))
        meta = {"unit": unit, "unit_parts": len(unit_buckets), "unit_size": self.cfg.extract.unit_size,
                "unit_stats": stats.as_dict(), "rank": self.rank, "world_size": self.world}
        part = f"u{unit:07d}"
        for group in plan_batches(samples, self.cfg.extract.tokens_per_batch, self.cfg.extract.max_batch_size,
                                  self.cfg.extract.batch_overhead):
            todo = [s for s in group if buckets[s.sample_id] not in done_buckets]
            if todo:  # batches are planned over the whole unit so a partial redo computes identical features
                self.run_batch(collate(group, self.pad_id), buckets, done_buckets, part, meta)
            self.progress.refresh()
        for b in unit_buckets:
            if b not in done_buckets:
                self.writer.submit_commit(b, part, meta)

    def run_batch(self, batch: Batch, buckets: dict[int, int], done: set[int], part: str, meta: dict) -> None:
        ids = batch.input_ids.to(self.device, non_blocking=True)  # [B, T]
        mask = batch.attention_mask.to(self.device, non_blocking=True)  # [B, T]
        t0 = time.perf_counter()
        if self.cfg.cache.store_target_argmax:
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


# -- the command ---------------------------------------------------------------------------------------


def group_by_unit(records: list[Record], unit_size: int) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = {}
    for r in records:
        out.setdefault(r.sample_id // unit_size, []).append(r)
    return out


def run_extraction(cfg: PipelineConfig, out_url: str, progress: bool = True) -> ExtractReport:
    """Extract teacher features for every sample of ``cfg.data`` into the cache at ``out_url``."""
    t_start = time.perf_counter()
    ctx = Distributed.start()
    budget_cpu_threads(ctx.device, 0, ctx.local_world_size)  # compute-bound: the writers need no reserved core
    log.info("extraction: %s", ctx.describe())
    try:
        return _run(cfg, out_url, ctx, progress, t_start)
    finally:
        ctx.close()


def _run(cfg: PipelineConfig, out_url: str, ctx: Distributed, show: bool, t_start: float) -> ExtractReport:
    data = load_records(cfg.data.path, cfg.data.skip_bad)
    model, tokenizer = load_teacher(cfg.teacher)
    if any(not r.pretokenized for r in data.records):
        check_chat_template(tokenizer)
    layer_ids = resolve_layer_ids(cfg.cache, num_decoder_layers(model))
    cache = open_output(ctx, out_url, build_spec(cfg, model, tokenizer, layer_ids, data.fingerprint), cfg, model)
    unit_size = cfg.extract.unit_size
    n_units = -(-data.n_total // unit_size)
    complete = complete_units(cache)
    partial = committed_units(cache)
    by_unit = group_by_unit(data.records, unit_size)
    mine = [u for u in range(n_units) if u % ctx.world_size == ctx.rank and u not in complete]
    todo_total = sum(len(by_unit.get(u, [])) for u in range(n_units) if u not in complete)
    report = ExtractReport(units_total=n_units, units_skipped=len(complete), n_bad=len(data.bad) if ctx.rank == 0 else 0)
    bar = ExtractProgress(ctx, todo_total, enabled=show)
    writer = BackgroundWriter(cache, cfg.extract.writer_threads, cfg.extract.max_inflight_bytes,
                              cfg.extract.on_nonfinite, on_commit=lambda info: bar.add(
                                  samples=info.n_samples, committed_samples=info.n_samples,
                                  bytes=sum(int(a.get("stored_bytes", 0)) for a in info.arrays.values())))
    runner = UnitRunner(cfg, model, tokenizer, cache, layer_ids, writer, bar, report)
    runner.rank, runner.world = ctx.rank, ctx.world_size
    log.info("rank %d/%d: %d of %d units to extract (%d already complete)", ctx.rank, ctx.world_size, len(mine),
             n_units, len(complete))
    t_loop = time.perf_counter()
    try:
        for u in mine:
            runner.run_unit(u, by_unit.get(u, []), partial.get(u, set()))
        stats = writer.close()
        report.loop_s = time.perf_counter() - t_loop
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    report.samples_written, report.tokens_written = stats.n_samples, stats.n_tokens
    report.parts_committed, report.bytes_written = stats.n_parts, stats.bytes_written
    report.n_nonfinite, report.stall_s = stats.n_nonfinite, stats.stall_s
    report.wall_s = time.perf_counter() - t_start
    return _finish(ctx, cache, report)


def _finish(ctx: Distributed, cache: Any, report: ExtractReport) -> ExtractReport:
    own_wall, own_fwd, own_loop = report.wall_s, report.forward_s, report.loop_s
    total = ctx.sum_counts(report.counts())
    for k, v in total.items():
        setattr(report, k, type(getattr(report, k))(v))
    report.units_total, report.units_skipped = int(total["units_total"] / ctx.world_size), int(
        total["units_skipped"] / ctx.world_size)
    report.wall_s, report.forward_s, report.loop_s = own_wall, own_fwd, own_loop  # per-process, not sums
    if ctx.rank == 0:
        cache.write_metadata("extract_report", {**report.counts(), "padding_fraction": report.padding_fraction,
                                                "world_size": ctx.world_size})
    ctx.barrier()
    return report


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-extract", description=__doc__.splitlines()[0])
    p.add_argument("config", help="TOML preset, e.g. configs/tiny.toml")
    p.add_argument("--out", required=True, help="cache path or fsspec URL (created, or resumed)")
    p.add_argument("--data", help="input data (overrides data.path)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--skip-bad", action="store_true", help="count and skip malformed records instead of failing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(list(argv))


def load_run_config(path: str, overrides: Sequence[str], data: str | None, skip_bad: bool) -> PipelineConfig:
    cfg = load_config(path, overrides)
    try:
        if data is not None:
            cfg.data.path = data
        if skip_bad:
            cfg.data.skip_bad = True
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg


def cli_main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    cfg = load_run_config(args.config, args.set, args.data, args.skip_bad)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report = run_extraction(cfg, args.out, progress=not args.no_progress)
    if process_rank() == 0:
        print(f"extracted into {args.out}")
        for line in report.lines():
            print("  " + line)
    return 0

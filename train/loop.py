"""The training loop: :func:`train` assembles the parts, resumes, then loops ``train_step`` → log → maybe
checkpoint / evaluate, until the planned number of steps.

Steps are numbered from 1 and count every attempted optimizer step, skipped ones included, so the
logs have no gaps; the learning-rate schedule counts applied updates only.

Exit codes: 0 done; 2 usage/config/data errors; 3 too many consecutive skipped steps
(:class:`~train.guards.TooManySkipsError`); 130 / 143 stopped by SIGINT / SIGTERM after a checkpoint.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_cache.runtime.config import config_to_dict
from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.schema import MetricsConfig, PipelineConfig
from dflash_cache.runtime.threads import budget_cpu_threads

from .batch import Batch
from .build import (
    batch_stream,
    build_loader,
    build_loss_module,
    build_model,
    build_optimizer,
    build_scheduler,
    drafter_metadata,
    total_steps_for,
)
from .checkpoint import Checkpointer, find_latest
from .estimate import check_fits
from .guards import SpikeGuard, TooManySkipsError
from .metrics import MetricLogger
from .signals import SignalFlag, TrainingInterrupted
from .state import resume, training_state
from .step import FaultPlan, StepResult, train_step

log = logging.getLogger(__name__)

RESOLVED_CONFIG_FILE = "config.json"


@dataclass
class TrainResult:
    step: int
    total_steps: int
    skipped: int
    checkpoint: Path | None
    stopped_by: str  # "done" | signal name


class HeldoutEval:
    """Teacher-forced acceptance on the held-out samples every ``eval.every_steps`` (rank 0).

    Every eligible anchor is scored, so it draws no random numbers: a resumed run stays bitwise exact.
    """

    def __init__(self, cache: Any, sample_ids: Any, max_blocks: int | None):
        self.cache, self.sample_ids, self.max_blocks = cache, sample_ids, max_blocks

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        from .evaluate import teacher_forced_eval

        t0 = time.perf_counter()
        res = teacher_forced_eval(model, self.cache, self.sample_ids, max_blocks=self.max_blocks)
        return {"eval/acceptance_length": res.acceptance_length, "eval/n_blocks": res.n_blocks,
                "eval/seconds": time.perf_counter() - t0}


def build_heldout_eval(cfg: PipelineConfig, cache: Any) -> HeldoutEval | None:
    from .evaluate import holdout_sample_ids

    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction)
    if len(ids) == 0:
        log.warning("eval.every_steps is set but the cache has no held-out samples at loader.holdout_fraction=%s; "
                    "periodic evaluation is off", cfg.loader.holdout_fraction)
        return None
    return HeldoutEval(cache, ids, cfg.eval.max_blocks)


def train(cfg: PipelineConfig, cache_url: str, run_dir: str | Path) -> TrainResult:
    """Train (or resume) a drafter on the cache at ``cache_url``, writing everything into ``run_dir``."""
    from dflash_cache import open_cache

    run_dir = Path(run_dir)
    d = Distributed.start()
    try:
        return _train(cfg, open_cache(cache_url), run_dir, d)
    finally:
        d.close()


def _train(cfg: PipelineConfig, cache: Any, run_dir: Path, d: Distributed) -> TrainResult:
    log.info("training: %s", d.describe())
    budget_cpu_threads(d.device, cfg.loader.num_readers, d.local_world_size)
    check_fits(cfg, cache, d.device)  # before any GPU memory is taken: the worst step must fit
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cache, d.device)
    optimizer = build_optimizer(cfg.train, model)
    loader = build_loader(cfg.loader, cache, d, seed=cfg.train.seed, epochs=cfg.train.epochs,
                          num_anchors=cfg.train.num_anchors, block_size=cfg.model.block_size)
    total_steps = total_steps_for(cfg.train, loader.epoch_lengths(cfg.train.epochs))
    scheduler = build_scheduler(cfg.train, optimizer, total_steps)
    guard = SpikeGuard(cfg.guards)
    resolved = config_to_dict(cfg)
    ckpt = Checkpointer(run_dir, cfg.checkpoint, config=resolved, cache_fingerprint=cache.spec.fingerprint,
                        is_writer=d.is_main, model_metadata=drafter_metadata(model))
    step = start_step = resume(cfg.checkpoint, ckpt, cache, model, optimizer, scheduler, loader, guard, d)
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESOLVED_CONFIG_FILE).write_text(json.dumps(resolved, indent=1))
    metrics = MetricLogger(run_dir, cfg.metrics, resume_step=step, enabled=d.is_main)
    loss_module = build_loss_module(cfg.train, model, d)
    faults = FaultPlan.from_env()
    signals = SignalFlag(cfg.checkpoint.save_on_signal)
    progress = _progress_bar(cfg.metrics, step, total_steps, d)
    batches = batch_stream(loader, cfg.train.epochs)
    stopped_by, stop_signal = "done", None
    heldout = build_heldout_eval(cfg, cache) if cfg.eval.every_steps and d.is_main else None

    def save(at_step: int) -> dict[str, Any]:
        state = training_state(at_step, optimizer, scheduler, loader, guard, cache, d)
        stats = ckpt.save(at_step, model.state_dict(), state)
        # blocking = waiting for the previous write (if still running) + the host snapshot
        return {"ckpt_blocking_ms": stats.blocking_ms, "ckpt_wait_ms": stats.wait_ms, "ckpt_saved_step": at_step}

    try:
        t_prev, cpu_prev = time.perf_counter(), time.thread_time()
        while step < total_steps:
            t_data = time.perf_counter()
            micro = _micro_batches(batches, cfg.train.grad_accum)
            if micro is None:
                break
            data_wait_ms = (time.perf_counter() - t_data) * 1e3
            step += 1
            model.train()
            res = train_step(step, micro, loss_module, optimizer, scheduler, guard, cfg.train, d, faults)
            record = _step_record(res, micro, loader, guard, data_wait_ms)
            stop_signal = signals.agreed(d)  # read once: a later signal counts next step
            if step % cfg.checkpoint.every_steps == 0 or step == total_steps or stop_signal:
                record.update(save(step))
            record.update(_completed_saves(ckpt))
            if heldout is not None and step % cfg.eval.every_steps == 0:
                record.update(heldout.evaluate(model))
            now, cpu_now = time.perf_counter(), time.thread_time()
            record["step_time_s"] = now - t_prev
            record["perf/step_cpu_s"] = cpu_now - cpu_prev  # training thread only: robust to other load
            record["tokens_per_s"] = record["n_tokens"] * d.world_size / max(now - t_prev, 1e-9)
            t_prev, cpu_prev = now, cpu_now
            metrics.log(step, record)
            _update_progress(progress, res, record)
            if res.verdict.skip:
                _log_skip(step, res, micro)
            if guard.should_stop:
                _stop_on_skips(step, guard, ckpt, run_dir)
            if stop_signal:
                stopped_by = signal.Signals(stop_signal).name
                break
        if step > start_step and ckpt.last_saved_step != step:  # the data ran out before total_steps
            save(step)
        ckpt.wait()
    finally:
        signals.restore()
        if progress is not None:
            progress.close()
        metrics.close()
        ckpt.close()
        loader.close()
    if stopped_by != "done":
        raise TrainingInterrupted(
            f"stopped by {stopped_by} after step {step}; checkpoint saved in {run_dir / 'checkpoints'}. "
            "Rerun the same command to resume.", stop_signal or signal.SIGTERM,
        )
    return TrainResult(step, total_steps, guard.total_skips, find_latest(run_dir) if d.is_main else None, "done")


def _micro_batches(it: Iterator[Batch], n: int) -> list[Batch] | None:
    out = []
    for _ in range(n):
        b = next(it, None)
        if b is None:
            return None
        out.append(b)
    return out


def _completed_saves(ckpt: Checkpointer) -> dict[str, Any]:
    """Background writes that finished since the last step (normally at most one)."""
    out: dict[str, Any] = {}
    for done_step, write_s in ckpt.pop_completed():
        out["ckpt_write_s"], out["ckpt_committed_step"] = write_s, done_step
    return out


def _step_record(res: StepResult, micro: Sequence[Batch], loader: Any, guard: SpikeGuard,
                 data_wait_ms: float) -> dict[str, Any]:
    """The per-step metrics (JSONL keys; TensorBoard tags are derived from them)."""
    n_tokens = sum(b.n_tokens for b in micro)
    n_padded = sum(b.n_padded for b in micro)
    rec: dict[str, Any] = {
        "loss": res.loss,
        "acceptance_length": res.metrics["acceptance_length"],
        "lr": res.lr,
        "grad_norm": res.grad_norm,
        "skipped": int(res.verdict.skip),
        "skipped_total": guard.total_skips,
        "loss_z": res.verdict.loss_z,
        "grad_norm_z": res.verdict.grad_z,
        "n_tokens": n_tokens,
        "n_blocks": res.metrics["n_blocks"],
        "padding_fraction": n_padded / max(1, n_tokens + n_padded),
        "epoch": micro[-1].epoch,
        "batch_index": micro[-1].index,
        "bucket": micro[-1].bucket,
        "perf/data_wait_ms": data_wait_ms,
    }
    for k, acc in enumerate(res.metrics["accuracy_per_position"], start=1):
        rec[f"acc/pos_{k}"] = acc
    for b, loss in res.metrics["bucket_loss"].items():
        rec[f"loss/bucket_{b}"] = loss
    stats = getattr(loader, "last_stats", None)
    if stats is not None:
        rec["perf/queue_depth"] = stats.queue_items
        rec["perf/queue_mb"] = stats.queue_bytes / 2**20
        rec["perf/loader_wait_ms"] = stats.data_wait_s * 1e3
    if res.verdict.skip:
        rec["skip_reason"] = res.verdict.reason
        rec["skipped_sample_ids"] = [int(i) for b in micro for i in b.sample_ids.tolist()]
    return rec


def _log_skip(step: int, res: StepResult, micro: Sequence[Batch]) -> None:
    ids = [int(i) for b in micro for i in b.sample_ids.tolist()]
    log.warning("step %d skipped (%s): loss %.4g, pre-clip grad norm %.4g, bucket %d, sample ids %s",
                step, res.verdict.reason, res.loss, res.grad_norm, micro[-1].bucket, ids)


def _stop_on_skips(step: int, guard: SpikeGuard, ckpt: Checkpointer, run_dir: Path) -> None:
    ckpt.wait()
    last = find_latest(run_dir)
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    raise TooManySkipsError(
        f"{guard.consecutive_skips} consecutive steps were skipped by the guards (up to step {step}; "
        f"see skip_reason in {run_dir / 'metrics.jsonl'} or run `dflash-train report {run_dir}`); "
        f"{where}. Lower train.lr, check the data of the listed sample ids, or raise "
        "guards.max_consecutive_skips / guards.z_threshold."
    )


def _progress_bar(metrics_cfg: MetricsConfig, step: int, total: int, d: Distributed):
    if not (metrics_cfg.progress_bar and d.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True)


def _update_progress(progress: Any, res: StepResult, rec: dict[str, Any]) -> None:
    if progress is None:
        return
    progress.update(1)
    progress.set_postfix(loss=f"{res.loss:.3f}", tau=f"{rec['acceptance_length']:.2f}",
                         tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)

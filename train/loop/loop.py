"""The training loop: :func:`train` claims the run dir, assembles the parts, resumes, then loops
``train_step`` → log → maybe evaluate / checkpoint, until the planned number of steps.

Steps are numbered from 1 and count every attempted optimizer step, skipped ones included, so the
logs have no gaps; the learning-rate schedule counts applied updates only. Each step's record is
written before the evaluation and checkpoint work that may follow it, and that work is timed on its
own: the step time and tokens/s are training figures.

Exit codes: 0 done; 2 usage/config/data errors; 3 too many consecutive skipped steps
(:class:`~train.components.guards.TooManySkipsError`); 130 / 143 stopped by SIGINT / SIGTERM after a checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_cache.protocols import ReadableCache
from dflash_cache.runtime.config import config_to_dict
from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.schema import PipelineConfig
from dflash_cache.runtime.switches import env_switch
from dflash_cache.runtime.threads import budget_cpu_threads
from train.config import MetricsConfig

from ..components.checkpoint import Checkpointer, find_latest
from ..components.guards import SpikeGuard, TooManySkipsError
from ..components.metrics import MetricLogger, StepTimer
from ..components.multinode import RankWatch
from ..components.rundir import RunDir
from ..components.signals import SignalFlag, TrainingInterrupted
from ..components.state import resume, training_components, training_state
from ..data.batch import Batch
from ..models.distill import check_loss_source
from ..protocols import TrainingLoader
from ..tools.estimate import check_fits
from .build import (
    batch_stream,
    build_loader,
    build_loss_module,
    build_model,
    build_optimizer,
    build_scheduler,
    drafter_metadata,
    open_training_cache,
    total_steps_for,
)
from .step import FaultPlan, StepResult, train_step

log = logging.getLogger(__name__)

# Test hook: seconds each held-out evaluation sleeps (inside its timed span), so a kill can land in it.
EVAL_DELAY_ENV = "DFLASH_TEST_EVAL_DELAY_S"


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

    def __init__(self, cache: ReadableCache, sample_ids: Any, max_blocks: int | None, skip_corrupt: bool = False):
        self.cache, self.sample_ids, self.max_blocks = cache, sample_ids, max_blocks
        self.skip_corrupt = skip_corrupt  # loader.on_corrupt = skip applies here too

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        from ..tools.evaluate import teacher_forced_eval

        t0 = time.perf_counter()
        res = teacher_forced_eval(model, self.cache, self.sample_ids, max_blocks=self.max_blocks,
                                  skip_corrupt=self.skip_corrupt)
        time.sleep(float(env_switch(EVAL_DELAY_ENV, "0") or 0))
        return {"eval/acceptance_length": res.acceptance_length, "eval/n_blocks": res.n_blocks,
                "eval/seconds": time.perf_counter() - t0}


def build_heldout_eval(cfg: PipelineConfig, cache: ReadableCache) -> HeldoutEval | None:
    from ..tools.evaluate import holdout_sample_ids

    skip = cfg.loader.on_corrupt == "skip"
    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction, skip_corrupt=skip)
    if len(ids) == 0:
        log.warning("eval.every_steps is set but the cache has no held-out samples at loader.holdout_fraction=%s; "
                    "periodic evaluation is off", cfg.loader.holdout_fraction)
        return None
    return HeldoutEval(cache, ids, cfg.eval.max_blocks, skip_corrupt=skip)


def train(cfg: PipelineConfig, cache_url: str, run_dir: str | Path) -> TrainResult:
    """Train (or resume) a drafter on the cache at ``cache_url``, writing everything into ``run_dir``."""
    d = Distributed.start(collective_timeout=timedelta(seconds=cfg.train.collective_timeout_s))
    watch = RankWatch(d, cfg.train.collective_timeout_s)
    finished = False
    try:
        with RunDir.claim(run_dir, d) as run:  # one trainer per run dir; exit 2 if it cannot be written
            result = _train(cfg, open_training_cache(cache_url, cfg.loader), run, d, watch)
        finished = True
        return result
    except RuntimeError as err:  # (torch's DistBackendError too) a collective that gave up on a rank
        named = watch.explain(err)
        if named is None:
            raise
        raise named from None
    finally:
        watch.close()
        if finished:  # every rank leaves after the last checkpoint is committed, rank 0 last
            d.leave_together(timedelta(seconds=cfg.train.collective_timeout_s))
        d.close()


def _train(cfg: PipelineConfig, cache: ReadableCache, run: RunDir, d: Distributed, watch: RankWatch | None = None
           ) -> TrainResult:
    log.info("training: %s", d.describe())  # a collective: every rank calls it
    budget_cpu_threads(d.device, cfg.loader.num_readers, d.local_world_size)
    check_loss_source(cfg.train.loss, cache.spec)  # a distribution loss needs the teacher's final state
    check_fits(cfg, cache, d.device)  # before any GPU memory is taken: the worst step must fit
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cache, d.device)
    optimizer = build_optimizer(cfg.train, model)
    loader = build_loader(cfg.loader, cache, d, seed=cfg.train.seed, epochs=cfg.train.epochs,
                          num_anchors=cfg.train.num_anchors, block_size=cfg.model.block_size)
    # live mode: the cache is still growing, so the run is scheduled by train.max_steps (the schema requires it)
    total_steps = (cfg.train.max_steps if cfg.loader.live
                   else total_steps_for(cfg.train, loader.epoch_lengths(cfg.train.epochs)))
    scheduler = build_scheduler(cfg.train, optimizer, total_steps)
    guard = SpikeGuard(cfg.guards)
    resolved = config_to_dict(cfg)
    ckpt = Checkpointer(run.path, cfg.checkpoint, config=resolved, cache_fingerprint=cache.spec.fingerprint,
                        is_writer=d.is_main, model_metadata=drafter_metadata(model))
    components = training_components(optimizer, scheduler, loader, guard, d)
    step = start_step = resume(cfg.checkpoint, ckpt, cache, model, components, d)
    run.write_config(resolved, d)
    metrics = MetricLogger(run.path, cfg.metrics, resume_step=step, enabled=d.is_main, run_config=resolved)
    loss_module = build_loss_module(cfg.train, model, d)
    faults = FaultPlan.from_env()
    signals = SignalFlag(cfg.checkpoint.save_on_signal)
    progress = _progress_bar(cfg.metrics, step, total_steps, d)
    batches = batch_stream(loader, cfg.train.epochs)
    heldout = build_heldout_eval(cfg, cache) if cfg.eval.every_steps and d.is_main else None
    timer = StepTimer()
    stopped_by, stop_signal = "done", None

    def save(at_step: int) -> dict[str, Any]:
        metrics.flush()  # durable first: a committed checkpoint never runs ahead of its logged steps
        state = training_state(at_step, components, cache, d)
        stats = ckpt.save(at_step, model.state_dict(), state)
        # blocking = waiting for the previous write (if still running) + the host snapshot
        return {"ckpt/blocking_ms": stats.blocking_ms, "ckpt/wait_ms": stats.wait_ms}

    finished = False
    try:
        while step < total_steps:
            t_data = time.perf_counter()
            micro = _micro_batches(batches, cfg.train.grad_accum)
            if micro is None:
                break
            data_wait_ms = (time.perf_counter() - t_data) * 1e3
            step += 1
            model.train()
            res = train_step(step, micro, loss_module, optimizer, scheduler, guard, cfg.train, d, faults)
            record = _step_record(res, micro, loader, guard, data_wait_ms, timer.lap(), d.world_size)
            metrics.log(step, record)  # before the slow work below: a kill during it loses no step
            if watch is not None:
                watch.beat(step)
            _update_progress(progress, res, record)
            if res.verdict.skip:
                _log_skip(step, res, micro, guard)
            elif res.verdict.rebaseline:
                _log_rebaseline(step, res, guard)
            stop_signal = signals.agreed(d)  # read once: a later signal counts next step
            with timer.excluded():  # timed as eval/seconds and ckpt/blocking_ms, not as training
                if heldout is not None and step % cfg.eval.every_steps == 0 and not stop_signal:
                    metrics.log(step, heldout.evaluate(model), kind="eval")
                if step % cfg.checkpoint.every_steps == 0 or step == total_steps or stop_signal:
                    metrics.log(step, save(step), kind="save")
            _log_commits(metrics, ckpt, step)
            if guard.should_stop:
                _stop_on_skips(step, guard, ckpt, run.path, cfg.train.optimizer)
            if stop_signal:
                stopped_by = signal.Signals(stop_signal).name
                break
        if step > start_step and ckpt.last_saved_step != step:  # the data ran out before total_steps
            log.info("the data ended at step %d of %d", step, total_steps)
            metrics.log(step, save(step), kind="save")
        ckpt.wait()
        _log_commits(metrics, ckpt, step)  # the last save's commit too
        finished = True
    finally:
        # every one closes, even after another's error: a checkpoint writer or reader thread left running
        # inside a C++ call when the interpreter exits aborts the process (SIGABRT) after the one-line error
        _close_all([signals.restore, *([progress.close] if progress is not None else []), metrics.close,
                    ckpt.close, loader.close], raise_first=finished)
    if stopped_by != "done":
        raise TrainingInterrupted(
            f"stopped by {stopped_by} after step {step}; checkpoint saved in {run.path / 'checkpoints'}. "
            "Rerun the same command to resume.", stop_signal or signal.SIGTERM,
        )
    return TrainResult(step, total_steps, guard.total_skips, find_latest(run.path) if d.is_main else None, "done")


def _close_all(closers: Sequence[Callable[[], object]], raise_first: bool) -> None:
    """Call each closer; raise the first error after all ran (``raise_first``), else only log them: the
    error already on its way out is the one to report."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as err:
            if raise_first and first is None:
                first = err
            else:
                log.warning("while closing after an error: %s", err)
    if first is not None:
        raise first


def _micro_batches(it: Iterator[Batch], n: int) -> list[Batch] | None:
    out = []
    for _ in range(n):
        b = next(it, None)
        if b is None:
            return None
        out.append(b)
    return out


def _log_commits(metrics: MetricLogger, ckpt: Checkpointer, step: int) -> None:
    """Background checkpoint writes that finished since the last call (normally at most one)."""
    for done_step, write_s in ckpt.pop_completed():
        metrics.log(step, {"ckpt/write_s": write_s, "ckpt/committed_step": done_step}, kind="commit")


def _step_record(res: StepResult, micro: Sequence[Batch], loader: TrainingLoader, guard: SpikeGuard, data_wait_ms: float,
                 lap: tuple[float, float], world_size: int) -> dict[str, Any]:
    """The step's training record (keys are the tags, listed in docs/metrics.md). ``lap``: wall and
    training-thread CPU seconds of the step, evaluation and checkpoint time excluded."""
    n_tokens = sum(b.n_tokens for b in micro)
    n_padded = sum(b.n_padded for b in micro)
    wall_s, cpu_s = lap
    rec: dict[str, Any] = {
        "train/loss": res.loss,
        "train/acceptance_length": res.metrics["acceptance_length"],
        "train/lr": res.lr,
        "train/grad_norm": res.grad_norm,
        "train/skipped": int(res.verdict.skip),
        "train/skipped_total": guard.total_skips,
        "train/loss_z": res.verdict.loss_z,
        "train/grad_norm_z": res.verdict.grad_z,
        "train/guard_rebaselines": guard.rebaselines,
        "train/n_tokens": n_tokens,
        "train/n_blocks": res.metrics["n_blocks"],
        "train/padding_fraction": n_padded / max(1, n_tokens + n_padded),
        "train/epoch": micro[-1].epoch,
        "train/batch_index": micro[-1].index,
        "train/bucket": micro[-1].bucket,
        "train/step_time_s": wall_s,
        "train/tokens_per_s": n_tokens * world_size / max(wall_s, 1e-9),
        "perf/step_cpu_s": cpu_s,  # training thread only: robust to other processes' load
        "perf/data_wait_ms": data_wait_ms,
    }
    for k, acc in enumerate(res.metrics["accuracy_per_position"], start=1):
        rec[f"acc/pos_{k}"] = acc
    for b, loss in res.metrics["bucket_loss"].items():
        rec[f"loss/bucket_{b}"] = loss
    rec.update(res.metrics.get("tags", {}))  # DFlash2: selector/* (docs/metrics.md)
    stats = getattr(loader, "last_stats", None)
    if stats is not None:
        rec["perf/queue_depth"] = stats.queue_items
        rec["perf/queue_mb"] = stats.queue_bytes / 2**20
        rec["perf/loader_wait_ms"] = stats.data_wait_s * 1e3
    if math.isfinite(res.verdict.grad_limit):  # once the guard is armed
        rec["train/grad_norm_limit"] = res.verdict.grad_limit
    if res.verdict.skip:
        rec["train/skip_reason"] = res.verdict.reason
        rec["train/skipped_sample_ids"] = [int(i) for b in micro for i in b.sample_ids.tolist()]
    return rec


def _log_skip(step: int, res: StepResult, micro: Sequence[Batch], guard: SpikeGuard) -> None:
    ids = [int(i) for b in micro for i in b.sample_ids.tolist()]
    log.warning("step %d skipped (%s): loss %.4g, pre-clip grad norm %.4g (limit %.4g), bucket %d, sample ids %s",
                step, res.verdict.reason, res.loss, res.grad_norm, res.verdict.grad_limit, micro[-1].bucket, ids)
    if res.verdict.reason == "grad_norm_spike" and guard.last_refusal:
        log.warning("step %d: not a level shift yet: %s", step, guard.last_refusal)


def _log_rebaseline(step: int, res: StepResult, guard: SpikeGuard) -> None:
    log.warning("step %d: the pre-clip grad norm has stayed at a new level (%.4g, limit was %.4g) while the loss "
                "did not rise: accepted as a level shift, the guard's window restarts there (re-baseline %d)",
                step, res.grad_norm, res.verdict.grad_limit, guard.rebaselines)


def _stop_on_skips(step: int, guard: SpikeGuard, ckpt: Checkpointer, run_dir: Path, optimizer: str) -> None:
    ckpt.wait()
    last = find_latest(run_dir)
    lr = "train.muon_lr (Muon's matrices) or train.lr" if optimizer == "muon" else "train.lr"
    if last:
        where = (f"the last good checkpoint is {last}; rerun the same command to resume from it (with a changed "
                 "setting, add --set checkpoint.allow_config_change=true)")
    else:
        where = ("no checkpoint was written yet: rerunning starts over from step 0 (the metrics so far are moved "
                 "aside)")
    if guard.last_refusal:
        what = f"the gradient norm jumped and was not accepted as a level shift because {guard.last_refusal}: " \
               f"this looks like a divergence. Lower {lr}, or check the data of the listed sample ids"
    else:
        what = (f"check the data of the listed sample ids, or lower {lr}; if the run was healthy, raise "
                "guards.max_consecutive_skips or guards.min_ratio")
    raise TooManySkipsError(
        f"{guard.consecutive_skips} consecutive steps were skipped by the guards (up to step {step}; "
        f"see train/skip_reason in {run_dir / 'metrics.jsonl'} or run `dflash-train report {run_dir}`). "
        f"{what}. {where}."
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
    progress.set_postfix(loss=f"{res.loss:.3f}", tau=f"{rec['train/acceptance_length']:.2f}",
                         tok_s=f"{rec['train/tokens_per_s']:.0f}", refresh=False)

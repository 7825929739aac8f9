"""``dflash-train CONFIG --cache CACHE --run-dir RUN``: the training loop.

Read top to bottom: :func:`train` assembles the parts (``build_*``), resumes from the latest
valid checkpoint in RUN, then loops ``train_step`` → log → maybe checkpoint. :func:`train_step`
is one optimizer step over ``train.grad_accum`` micro-batches with the guards in front of the
update: a skipped step leaves parameters, optimizer moments and the schedule bitwise unchanged.

Steps are numbered from 1 and count every attempted optimizer step, skipped ones included, so the
logs have no gaps; the learning-rate schedule counts applied updates only.

Exit codes: 0 done; 2 usage/config/data errors; 3 too many consecutive skipped steps
(:class:`~train.guards.TooManySkipsError`); 130 / 143 stopped by SIGINT / SIGTERM after a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from dflash_cache.config import config_to_dict, load_config
from dflash_cache.errors import DFlashError, SpecMismatchError
from dflash_cache.schema import PipelineConfig, TrainConfig
from dflash_cache.threads import budget_cpu_threads

from .batch import Batch
from .checkpoint import Checkpointer, LoadedCheckpoint
from .guards import SpikeGuard, TooManySkipsError, Verdict
from .metrics import MetricLogger

log = logging.getLogger(__name__)

RESOLVED_CONFIG_FILE = "config.json"


class TrainingInterrupted(DFlashError):
    """SIGINT/SIGTERM: the run saved a checkpoint and stopped; rerunning the command resumes."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


# ----------------------------------------------------------------------------------------------
# Assembly
# ----------------------------------------------------------------------------------------------


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def build_distributed() -> DistInfo:
    """Join the process group when launched by torchrun / accelerate (gloo on CPU, nccl on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world, local, device)


def build_model(cfg: PipelineConfig, cache: Any, device: torch.device) -> nn.Module:
    """The drafter on ``device`` in fp32 (master weights); only its own layers are trainable."""
    from .model import build_drafter

    model = build_drafter(cfg.model, cache.spec, cache.load_head()).to(device)
    for p in model.parameters():  # fp32 master weights; the frozen head buffers keep their dtype (memory)
        p.data = p.data.float()
    # the frozen embedding / lm_head are buffers; make sure nothing else sneaks in as trainable
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    return model


def drafter_metadata(model: nn.Module) -> dict[str, str]:
    """Stored in every checkpoint's model.safetensors: export needs no cache to rebuild the drafter."""
    from .model import METADATA_KEY

    return {METADATA_KEY: model.config.to_json()}


def build_optimizer(train_cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay)


def lr_lambda(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the ``step``-th applied update (0-based): linear warmup, cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(train_cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    warmup = math.ceil(train_cfg.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, total_steps, warmup, train_cfg.min_lr_ratio)
    )


def build_loader(cfg: PipelineConfig, cache: Any, dist_info: DistInfo) -> Any:
    """The streaming loader over this rank's slice of the plan (batches land on the training device)."""
    from .loader import StreamingLoader

    return StreamingLoader(cache, cfg.loader, seed=cfg.train.seed, rank=dist_info.rank,
                           world_size=dist_info.world_size, device=dist_info.device, max_epochs=cfg.train.epochs)


def batch_stream(loader: Any, epochs: int) -> Iterator[Batch]:
    """Every remaining batch of this rank, epoch after epoch (the loader yields one epoch per pass)."""
    while loader.epoch < epochs:
        yield from loader


def total_steps_for(train_cfg: TrainConfig, epoch_lengths: Sequence[int]) -> int:
    """Optimizer steps of the run: all batches of all epochs over grad_accum, capped by max_steps."""
    total = sum(epoch_lengths) // train_cfg.grad_accum
    if total < 1:
        raise DFlashError(
            f"the run has {sum(epoch_lengths)} batches per rank, fewer than train.grad_accum="
            f"{train_cfg.grad_accum}; lower train.grad_accum or loader.tokens_per_batch, or add data"
        )
    return min(total, train_cfg.max_steps) if train_cfg.max_steps else total


def autocast_context(train_cfg: TrainConfig, device: torch.device):
    """bf16 autocast on GPU (auto/bf16); fp32 on CPU unless bf16 is asked for explicitly."""
    use_bf16 = train_cfg.precision == "bf16" or (train_cfg.precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class LossModule(nn.Module):
    """Wraps the drafter so DDP sees the whole loss computation as its forward."""

    def __init__(self, drafter: nn.Module, num_anchors: int, gamma: float | None):
        super().__init__()
        self.drafter = drafter
        self.num_anchors = num_anchors
        self.gamma = gamma

    def forward(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        from .objective import dflash_loss

        out = dflash_loss(self.drafter, batch, num_anchors=self.num_anchors, gamma=self.gamma)
        return out.loss, out.metrics


def build_loss_module(train_cfg: TrainConfig, model: nn.Module, dist_info: DistInfo) -> nn.Module:
    module: nn.Module = LossModule(model, train_cfg.num_anchors, train_cfg.loss_gamma)
    if dist_info.enabled:
        ids = [dist_info.local_rank] if dist_info.device.type == "cuda" else None
        module = nn.parallel.DistributedDataParallel(module, device_ids=ids)
    return module


# ----------------------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    verdict: Verdict
    lr: float
    metrics: dict[str, Any]  # acceptance_length, accuracy_per_position, loss per bucket ...


def fault_scale(train_cfg: TrainConfig, step: int) -> float:
    """The test hook: NaN / spike injection multiplies the loss of the listed steps (1.0 otherwise)."""
    if step in train_cfg.inject_nan_steps:
        return math.nan
    if step in train_cfg.inject_spike_steps:
        return train_cfg.inject_spike_scale
    return 1.0


def _reduce_sums(sums: Tensor, dist_info: DistInfo) -> Tensor:
    if dist_info.enabled:
        dist.all_reduce(sums)
    return sums


def train_step(
    step: int,
    micro_batches: Sequence[Batch],
    loss_module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    guard: SpikeGuard,
    train_cfg: TrainConfig,
    dist_info: DistInfo,
) -> StepResult:
    """Forward/backward over the micro-batches, guard, then (unless skipped) clip + AdamW + schedule."""
    device = dist_info.device
    params = list(optimizer.param_groups[0]["params"])
    lr = optimizer.param_groups[0]["lr"]
    scale = fault_scale(train_cfg, step)
    n_micro = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    acc = _MetricSums()
    for i, batch in enumerate(micro_batches):
        batch = batch.to(device)
        sync = i == n_micro - 1 or not dist_info.enabled  # DDP all-reduces gradients on the last micro-batch
        with nullcontext() if sync else loss_module.no_sync():
            with autocast_context(train_cfg, device):
                loss, metrics = loss_module(batch)
            loss = loss.float() * scale  # []; scale is 1.0 unless a fault is injected on this step
            (loss / n_micro).backward()
        loss_sum += loss.detach().float()
        acc.add(batch.bucket, loss.detach().float(), metrics)
    # pre-clip total norm; identical on every rank since DDP has averaged the gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip).float()
    loss_mean = _reduce_sums(loss_sum.reshape(1), dist_info).item() / (n_micro * dist_info.world_size)
    gn = grad_norm.item()
    verdict = guard.check(loss_mean, gn)
    if not verdict.skip:
        optimizer.step()
        scheduler.step()
    guard.update(verdict, loss_mean, gn)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_mean, gn, verdict, lr, acc.finish(dist_info))


class _MetricSums:
    """Exact aggregation of the objective's sums over micro-batches (and ranks)."""

    def __init__(self) -> None:
        self.n_blocks: Tensor | None = None
        self.accepted: Tensor | None = None
        self.pos_correct: Tensor | None = None
        self.pos_count: Tensor | None = None
        self.bucket_loss: dict[int, list[Tensor]] = {}

    def add(self, bucket: int, loss: Tensor, m: dict[str, Tensor]) -> None:
        def plus(a: Tensor | None, b: Tensor) -> Tensor:
            b = b.detach().double()
            return b if a is None else a + b

        self.n_blocks = plus(self.n_blocks, m["n_blocks"])
        self.accepted = plus(self.accepted, m["accepted_sum"])
        self.pos_correct = plus(self.pos_correct, m["position_correct"])
        self.pos_count = plus(self.pos_count, m["position_count"])
        self.bucket_loss.setdefault(int(bucket), []).append(loss)

    def finish(self, dist_info: DistInfo) -> dict[str, Any]:
        assert self.n_blocks is not None and self.accepted is not None
        assert self.pos_correct is not None and self.pos_count is not None
        # [2 + 2*(B-1)]: one all-reduce for every block metric
        packed = torch.cat([self.n_blocks.reshape(1), self.accepted.reshape(1), self.pos_correct, self.pos_count])
        packed = _reduce_sums(packed, dist_info).cpu()
        nb = int(packed[0].item())
        k = (packed.numel() - 2) // 2
        correct, count = packed[2 : 2 + k], packed[2 + k :]
        out: dict[str, Any] = {
            "n_blocks": nb,
            "acceptance_length": 1.0 + float(packed[1]) / max(nb, 1),
            "accuracy_per_position": (correct / count.clamp(min=1)).tolist(),
        }
        # per-bucket loss of this rank's micro-batches (buckets differ between ranks)
        out["bucket_loss"] = {b: float(torch.stack(v).mean()) for b, v in self.bucket_loss.items()}
        return out


# ----------------------------------------------------------------------------------------------
# Resume, RNG, signals
# ----------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_cache_compatible(ckpt: LoadedCheckpoint, cache: Any, ignore: bool) -> None:
    """Refuse to resume on a cache other than the one the checkpoint was trained on."""
    saved_fp = ckpt.manifest.get("cache_fingerprint")
    if saved_fp == cache.spec.fingerprint:
        return
    from dflash_cache.spec import CacheSpec

    saved = CacheSpec.from_dict(ckpt.state["cache_spec"])
    fields = saved.diff(cache.spec) or ["fingerprint"]
    detail = ", ".join(fields)
    if ignore:
        log.warning("resuming %s on a cache that differs in %s (checkpoint.ignore_fingerprint_mismatch)",
                    ckpt.path, detail)
        return
    raise SpecMismatchError(
        f"checkpoint {ckpt.path} was trained on cache fingerprint {saved_fp}, but {cache.url} has "
        f"{cache.spec.fingerprint} (differs in: {detail}); use the original cache, a new --run-dir, or "
        "--set checkpoint.ignore_fingerprint_mismatch=true to resume anyway",
        fields=fields,
    )


class SignalFlag:
    """Turns SIGTERM/SIGINT into a flag the loop checks after each step (then saves and stops)."""

    def __init__(self, enabled: bool) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # a second signal: stop hard
            raise KeyboardInterrupt
        log.warning("received %s: saving a checkpoint after this step", signal.Signals(signum).name)
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    step: int
    total_steps: int
    skipped: int
    checkpoint: Path | None
    stopped_by: str  # "done" | signal name


def _per_rank(value: Any, d: DistInfo) -> list[Any]:
    """``value`` of every rank, indexed by rank (a collective: every rank calls it at the same step)."""
    if not d.enabled:
        return [value]
    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, value)  # our own processes' small JSON-able states, not files
    return out


def _training_state(step: int, optimizer, scheduler, loader, guard: SpikeGuard, cache: Any,
                    d: DistInfo) -> dict[str, Any]:
    """Everything a resume needs; loader position and RNG are per rank (each rank reads its own slice)."""
    return {
        "step": step,
        "world_size": d.world_size,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loader": _per_rank(loader.state_dict(), d),
        "guard": guard.state_dict(),
        "rng": _per_rank(rng_state(), d),
        "cache_spec": cache.spec.to_dict(),
    }


def _agreed_signal(signum: int | None, d: DistInfo) -> int | None:
    """The stop signal, agreed by all ranks (a signal seen by any rank stops all at the same step)."""
    if not d.enabled:
        return signum
    flag = torch.tensor([signum or 0], dtype=torch.int64, device=d.device)  # nccl needs it on the GPU
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) or None


def _micro_batches(it: Iterator[Batch], n: int) -> list[Batch] | None:
    out = []
    for _ in range(n):
        b = next(it, None)
        if b is None:
            return None
        out.append(b)
    return out


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
    d = build_distributed()
    budget_cpu_threads(d.device, cfg.loader.num_readers)
    torch.manual_seed(cfg.train.seed)
    cache = open_cache(cache_url)
    model = build_model(cfg, cache, d.device)
    optimizer = build_optimizer(cfg.train, model)
    loader = build_loader(cfg, cache, d)
    total_steps = total_steps_for(cfg.train, loader.epoch_lengths(cfg.train.epochs))
    scheduler = build_scheduler(cfg.train, optimizer, total_steps)
    guard = SpikeGuard(cfg.guards)
    resolved = config_to_dict(cfg)
    ckpt = Checkpointer(run_dir, cfg.checkpoint, config=resolved, cache_fingerprint=cache.spec.fingerprint,
                        is_writer=d.is_main, model_metadata=drafter_metadata(model))
    step = start_step = _resume(cfg, ckpt, cache, model, optimizer, scheduler, loader, guard, d)
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESOLVED_CONFIG_FILE).write_text(json.dumps(resolved, indent=1))
    metrics = MetricLogger(run_dir, cfg.metrics, resume_step=step, enabled=d.is_main)
    loss_module = build_loss_module(cfg.train, model, d)
    signals = SignalFlag(cfg.checkpoint.save_on_signal)
    progress = _progress_bar(cfg, step, total_steps, d)
    batches = batch_stream(loader, cfg.train.epochs)
    stopped_by, stop_signal = "done", None
    heldout = build_heldout_eval(cfg, cache) if cfg.eval.every_steps and d.is_main else None

    def save(at_step: int) -> dict[str, Any]:
        state = _training_state(at_step, optimizer, scheduler, loader, guard, cache, d)
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
            res = train_step(step, micro, loss_module, optimizer, scheduler, guard, cfg.train, d)
            record = _step_record(res, micro, loader, guard, data_wait_ms)
            stop_signal = _agreed_signal(signals.signum, d)  # read once: a later signal counts next step
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
        _close_loader(loader)
    if stopped_by != "done":
        raise TrainingInterrupted(
            f"stopped by {stopped_by} after step {step}; checkpoint saved in {run_dir / 'checkpoints'}. "
            "Rerun the same command to resume.", stop_signal or signal.SIGTERM,
        )
    from .checkpoint import find_latest

    return TrainResult(step, total_steps, guard.total_skips, find_latest(run_dir) if d.is_main else None, "done")


def _resume(cfg: PipelineConfig, ckpt: Checkpointer, cache: Any, model, optimizer, scheduler, loader,
            guard: SpikeGuard, d: DistInfo) -> int:
    latest = ckpt.load_latest()
    if latest is None:
        return 0
    if not cfg.checkpoint.resume:
        raise DFlashError(
            f"checkpoint.resume is false but {latest.path.parent} already holds checkpoints (latest: step "
            f"{latest.step}); starting over there would mix two runs. Use a new --run-dir, or delete "
            f"{latest.path.parent} to start this one from scratch"
        )
    check_cache_compatible(latest, cache, cfg.checkpoint.ignore_fingerprint_mismatch)
    saved_world = int(latest.state["world_size"])
    if saved_world != d.world_size:
        raise DFlashError(
            f"checkpoint {latest.path} was written by a run with {saved_world} process(es), this run has "
            f"{d.world_size}; each rank resumes its own slice of the plan, so resume with "
            f"--nproc-per-node {saved_world} (or start a new --run-dir)"
        )
    model.load_state_dict(latest.model)
    optimizer.load_state_dict(latest.state["optimizer"])
    scheduler.load_state_dict(latest.state["scheduler"])
    loader.load_state_dict(latest.state["loader"][d.rank])
    guard.load_state_dict(latest.state["guard"])
    set_rng_state(latest.state["rng"][d.rank])
    log.info("resumed from %s (step %d)", latest.path, latest.step)
    return latest.step


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
    from .checkpoint import find_latest

    last = find_latest(run_dir)
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    raise TooManySkipsError(
        f"{guard.consecutive_skips} consecutive steps were skipped by the guards (up to step {step}; "
        f"see skip_reason in {run_dir / 'metrics.jsonl'} or run `dflash-train report {run_dir}`); "
        f"{where}. Lower train.lr, check the data of the listed sample ids, or raise "
        "guards.max_consecutive_skips / guards.z_threshold."
    )


def _close_loader(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if callable(close):
        close()


def _progress_bar(cfg: PipelineConfig, step: int, total: int, d: DistInfo):
    if not (cfg.metrics.progress_bar and d.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True)


def _update_progress(progress: Any, res: StepResult, rec: dict[str, Any]) -> None:
    if progress is None:
        return
    progress.update(1)
    progress.set_postfix(loss=f"{res.loss:.3f}", tau=f"{rec['acceptance_length']:.2f}",
                         tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash drafter from a feature cache. Rerunning the same command resumes "
        "from the latest checkpoint in --run-dir. Subcommands: eval, export, report.",
    )
    p.add_argument("config", help="TOML preset, e.g. configs/tiny.toml")
    p.add_argument("--cache", required=True, help="feature cache (path or fsspec URL) from dflash-extract")
    p.add_argument("--run-dir", required=True, help="where checkpoints, metrics.jsonl and TensorBoard logs go")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=100 (repeatable)")
    return p


def cli_main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    result = train(cfg, args.cache, args.run_dir)
    if result.checkpoint is not None:
        print(f"trained {result.step}/{result.total_steps} steps ({result.skipped} skipped); "
              f"checkpoint: {result.checkpoint}")
    return 0

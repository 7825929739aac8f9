"""Step time of the full trainer vs a bare forward/backward/clip/AdamW loop on the same batches.

Figures are per-step medians; with ``--threads 1`` (default) the training-thread CPU time is the
primary figure, since wall time on a shared 2-core machine swings by 2-5x with other load.

The full trainer is ``train.loop.loop.train`` (loader, guards, metrics to TensorBoard + JSONL every step,
checkpoints every ``--ckpt-every`` steps, progress bar off); its per-step wall time comes from
``metrics.jsonl`` (``train/step_time_s``: training only, evaluation and checkpoint time excluded). The bare loop runs the same model config on the batches the
same loader yields, already in memory. "loop" is the trainer fed those in-memory batches (its own
overhead: guards, metrics, checkpoints); "full" uses the streaming loader. Goal: <= 1.05.

    .venv/bin/python bench/bench_trainer.py [--steps 40] [--config configs/tiny.toml]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import train.loop.loop as loop_mod
from dflash_cache import open_cache
from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.dist import Distributed
from dflash_cache.synthetic import make_synthetic_cache
from train.components.metrics import read_metrics
from train.loop.build import (
    autocast_context,
    batch_stream,
    build_loader,
    build_model,
    build_position_weighting,
)
from train.loop.loop import train
from train.models.objective import dflash_loss

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 3


def bare_step_times(cfg, cache, batches: list) -> tuple[list[float], list[float]]:
    """Wall and training-thread CPU seconds per step of a bare fwd/bwd/clip/AdamW loop."""
    d = Distributed()
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cache, d.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=cfg.train.betas)
    weighting = build_position_weighting(cfg.train, model.config.block_size)
    times, cpu = [], []
    for batch in batches:
        t0, c0 = time.perf_counter(), time.thread_time()
        batch = batch.to(d.device)
        with autocast_context(cfg.train, d.device):
            out = dflash_loss(model, batch, num_anchors=cfg.train.num_anchors, weighting=weighting)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if d.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return times[WARMUP:], cpu[WARMUP:]


class InMemoryLoader:
    """The loader interface the trainer uses, over batches already read (isolates the loop's own cost)."""

    def __init__(self, batches: list, epochs: int):
        self.batches, self.epochs, self.epoch, self.last_stats = batches, epochs, 0, None

    def epoch_lengths(self, epochs: int) -> list[int]:
        return [len(self.batches)] * epochs

    def __iter__(self):
        yield from self.batches
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]

    def close(self) -> None:
        pass


def collect_batches(cfg, cache, n: int) -> list:
    # batches stay on the host; each loop moves them
    loader = build_loader(cfg.loader, cache, Distributed(), seed=cfg.train.seed, epochs=cfg.train.epochs,
                          num_anchors=cfg.train.num_anchors, block_size=cfg.model.block_size)
    out = []
    for b in batch_stream(loader, cfg.train.epochs):
        out.append(b)
        if len(out) == n:
            break
    loader.close()
    return out


def full_step_times(cfg, url: str, run_dir: Path, batches: list | None) -> tuple[list[float], list[float], list[float]]:
    """Per-step wall and training-thread CPU seconds of ``train()``, and checkpoint blocking ms;
    ``batches``: use an in-memory loader over them."""
    original = loop_mod.build_loader
    if batches is not None:
        loop_mod.build_loader = lambda loader_cfg, cache, d, *, seed, epochs, **_: InMemoryLoader(batches, epochs)
    try:
        train(cfg, url, run_dir)
    finally:
        loop_mod.build_loader = original
    recs = read_metrics(run_dir)
    return ([r["train/step_time_s"] for r in recs][WARMUP:], [r["perf/step_cpu_s"] for r in recs][WARMUP:],
            [r["ckpt/blocking_ms"] for r in read_metrics(run_dir, kind="save")])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--cache", help="an existing cache (default: a synthetic one)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the synthetic cache")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary of the synthetic cache")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # 1: all compute on the training thread, so its CPU time is the step's
    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    try:
        url = args.cache
        if url is None:
            url = str(tmp / "cache")
            make_synthetic_cache(url, n_samples=256, hidden_size=args.hidden, num_layers=8,
                                 target_layer_ids=(1, 3, 5), vocab_size=args.vocab, max_length=256, median_length=96)
        overrides = [f"train.max_steps={args.steps}", f"checkpoint.every_steps={args.ckpt_every}",
                     "metrics.progress_bar=false", "train.epochs=50"]
        if args.cache is None:
            overrides.append(f"model.mask_token_id={args.vocab - 1}")
        overrides += args.overrides
        cfg = load_config(args.config, overrides)
        cache = open_cache(url)
        batches = collect_batches(cfg, cache, args.steps)
        # the three loops alternate, --repeats times; each figure is the lowest per-repeat median, so a
        # burst of load from other processes on a shared machine does not land on one side only
        wall: dict[str, list[float]] = {"bare": [], "loop": [], "full": []}
        cpu: dict[str, list[float]] = {"bare": [], "loop": [], "full": []}
        saves: list[float] = []
        for r in range(args.repeats):
            runs = {"bare": bare_step_times(cfg, cache, batches),
                    "loop": full_step_times(cfg, url, tmp / f"mem{r}", batches)[:2]}
            *runs["full"], blocking = full_step_times(cfg, url, tmp / f"full{r}", None)
            saves += blocking
            for name, (w, c) in runs.items():
                wall[name].append(statistics.median(w))
                cpu[name].append(statistics.median(c))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    w, c = {k: min(v) for k, v in wall.items()}, {k: min(v) for k, v in cpu.items()}
    res = {
        "device": "cuda" if torch.cuda.is_available() else "cpu", "torch_threads": torch.get_num_threads(),
        "steps_per_run": args.steps - WARMUP, "repeats": args.repeats,
        "cpu_step_s": c, "wall_step_s": w,
        "loop_over_bare_cpu": c["loop"] / c["bare"], "full_over_bare_cpu": c["full"] / c["bare"],
        "loop_over_bare_wall": w["loop"] / w["bare"], "full_over_bare_wall": w["full"] / w["bare"],
        "per_repeat_medians_wall_s": wall,
        "ckpt_blocking_ms_mean": statistics.fmean(saves) if saves else 0.0, "goal": 1.05,
        "note": "loop = the trainer with batches in memory; full = with the streaming loader. cpu = "
        "training-thread CPU time (robust to other processes' load on a shared machine; excludes the "
        "loader's reader threads and the checkpoint writer, which run beside the training thread)",
    }
    for k, v in res.items():
        print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")
    RESULTS.mkdir(exist_ok=True)
    name = "bench_trainer.json" if res["device"] == "cpu" else f"bench_trainer_{res['device']}.json"
    (RESULTS / name).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

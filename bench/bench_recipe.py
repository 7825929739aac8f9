"""Recipe comparison: {exp_decay, dpace} x {adamw, muon} on the tiny demo drafter, the same steps each.

Trains the drafter of ``configs/tiny.toml`` on the demo's cache (``runs/demo/cache`` when present, else
built once with the demo's regenerate + extract stages into ``--workdir``) for ``--steps`` optimizer steps
per run, for every combination and ``--seeds`` seeds (``train.seed``: initialisation, plan order and
anchors), started seed by seed so that load from other processes spreads over all combinations
(``--jobs`` runs at a time, each in its own process with one torch thread). Each run is scored by the
held-out teacher-forced acceptance length tau (every eligible anchor of the demo's held-out samples), and
timed: wall and training-thread CPU seconds of the training loop (CPU time is the figure to compare when
other processes, or the other jobs, share the cores).
Reports the median and range over seeds per combination, and each combination's paired difference in tau
to the reference recipe (exp_decay + adamw) at the same seed. Writes ``bench/results/bench_recipe.json``.

    .venv/bin/python bench/bench_recipe.py [--steps 100] [--seeds 3] [--jobs 4] [--set train.muon_lr=3e-2]

DFlash vs DFlash2 (``model.arch``): a combination may name the family as a third part,
``--combos dpace+muon+dflash dpace+muon+dflash2 --reference dpace+muon+dflash``; a DFlash2 run is scored by its
selector's teacher-forced greedy path (which is its greedy acceptance; see train/dflash2.py).

The figures in docs/recipe.md: ``--steps 100 --jobs 4`` (bench_recipe.json) and ``--steps 500 --seeds 1
--jobs 2 --combos exp_decay+adamw dpace+muon --out bench/results/bench_recipe_500steps.json``, both with
``--set train.muon_lr=3e-2`` (now the tiny preset's own value).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dflash_cache import open_cache
from dflash_cache.runtime.config import load_config
from train.evaluate import holdout_sample_ids, load_for_eval, teacher_forced_eval
from train.loop import train
from train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = ROOT / "configs" / "tiny.toml"
WEIGHTINGS = ("exp_decay", "dpace")
OPTIMIZERS = ("adamw", "muon")
REFERENCE = "exp_decay+adamw"


def demo_cache(workdir: Path, config: str) -> str:
    """The demo's cache: runs/demo/cache if a demo ran, else regenerate + extract once into ``workdir``."""
    existing = ROOT / "runs" / "demo" / "cache"
    if (existing / "zarr.json").exists():
        return str(existing)
    cache = workdir / "cache"
    if not (cache / "zarr.json").exists():
        from extract.cli import main as extract_main

        regenerated = workdir / "regenerated.jsonl"
        if extract_main(["regenerate", config, "--out", str(regenerated)]):
            raise SystemExit("regenerate failed (its error is printed above)")
        if extract_main([config, "--data", str(regenerated), "--out", str(cache)]):
            raise SystemExit("extract failed (its error is printed above)")
    return str(cache)


def run_one(config: str, overrides: list[str], cache_url: str, run_dir: Path) -> dict[str, Any]:
    """Train one combination; its held-out tau and the training loop's time."""
    torch.set_num_threads(1)  # the tiny drafter's ops are too small to split; threads only contend on 2 cores
    cfg = load_config(config, overrides)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = train(cfg, cache_url, run_dir)
    wall = time.perf_counter() - t0
    records = read_metrics(run_dir)
    cache = open_cache(cache_url)
    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction)
    tf = teacher_forced_eval(load_for_eval(str(run_dir), cache, cfg.model.attention), cache, ids)
    return {
        "tau": tf.acceptance_length, "heldout_blocks": tf.n_blocks, "steps": result.step,
        "skipped_steps": result.skipped, "train_wall_s": round(wall, 2),
        "train_cpu_s": round(sum(r["perf/step_cpu_s"] for r in records), 2),
        "final_loss": records[-1]["train/loss"], "accuracy_per_position": tf.per_position_accuracy,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per run (the demo trains ~500)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1, help="train.seed of the first seed (seed 0 is the one "
                    "the learning rates were probed on; see docs/recipe.md)")
    ap.add_argument("--jobs", type=int, default=4, help="runs at a time (separate processes)")
    ap.add_argument("--combos", nargs="*", default=None,
                    help=f"subset of WEIGHTING+OPTIMIZER to run (default: all of {WEIGHTINGS} x {OPTIMIZERS})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides for every run")
    ap.add_argument("--cache", help="the cache to train on (default: the demo's, see above)")
    ap.add_argument("--workdir", default="/tmp/bench_recipe", help="the run dirs, and the cache if built here")
    ap.add_argument("--out", default=str(RESULTS / "bench_recipe.json"))
    ap.add_argument("--reference", default=REFERENCE, help="the combination the paired tau differences are to")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cache_url = args.cache or demo_cache(workdir, args.config)
    combos = args.combos or [f"{w}+{o}" for w in WEIGHTINGS for o in OPTIMIZERS]
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in combos}
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for combo in combos:
                weighting, optimizer, *arch = combo.split("+")
                overrides = [f"train.max_steps={args.steps}", f"train.seed={seed}", f"model.arch={(arch or ['dflash'])[0]}",
                             f"train.loss_weighting={weighting}", f"train.optimizer={optimizer}",
                             "metrics.progress_bar=false", "metrics.tensorboard=false",
                             "eval.every_steps=1000000", f"checkpoint.every_steps={args.steps}", *args.overrides]
                run_dir = workdir / "runs" / f"{combo}-seed{seed}"
                futures.append((combo, seed, pool.submit(run_one, args.config, overrides, cache_url, run_dir)))
        for combo, seed, fut in futures:
            res = fut.result()
            res["seed"] = seed
            runs[combo].append(res)
            print(f"{combo:>16} seed {seed}: tau {res['tau']:.3f}  loss {res['final_loss']:.3f}  "
                  f"train {res['train_wall_s']:.0f} s wall / {res['train_cpu_s']:.0f} s cpu  "
                  f"load {res['loadavg_1m_at_end']}", flush=True)
    summary: dict[str, Any] = {}
    for combo, rs in runs.items():
        entry = {"tau": summarize([r["tau"] for r in rs]),
                 "train_wall_s": summarize([r["train_wall_s"] for r in rs]),
                 "train_cpu_s": summarize([r["train_cpu_s"] for r in rs])}
        if args.reference in runs and combo != args.reference:
            entry["tau_minus_reference"] = summarize([r["tau"] - ref["tau"] for r, ref in zip(rs, runs[args.reference],
                                                                                              strict=True)])
        summary[combo] = entry
    out = {
        "config": str(Path(args.config).relative_to(ROOT)) if Path(args.config).is_relative_to(ROOT) else args.config,
        "overrides": args.overrides, "steps_per_run": args.steps,
        "seeds": list(range(args.first_seed, args.first_seed + args.seeds)), "cache": cache_url,
        "heldout_blocks": runs[combos[0]][0]["heldout_blocks"], "torch_threads": 1, "jobs": args.jobs,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "total_s": round(time.perf_counter() - t_start, 1), "summary": summary, "runs": runs,
        "note": "tau: held-out teacher-forced acceptance length (1 + leading correct rows per block), every "
        "eligible anchor of the held-out samples; median [min, max] over seeds; tau_minus_reference: paired by "
        f"seed against {args.reference}. train_cpu_s: training-thread CPU seconds (robust to other processes' load).",
    }
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

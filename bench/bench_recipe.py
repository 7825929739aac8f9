"""Recipe comparison: {exp_decay, dpace} x {adamw, muon} (x train.loss) on the tiny demo drafter, the same steps each.

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
selector's teacher-forced greedy path (which is its greedy acceptance; see train/models/dflash2.py).

The figures in docs/recipe.md: ``--steps 100 --jobs 4`` (bench_recipe.json) and ``--steps 500 --seeds 1
--jobs 2 --combos exp_decay+adamw dpace+muon --out bench/results/bench_recipe_500steps.json``, both with
``--set train.muon_lr=3e-2`` (now the tiny preset's own value). The loss comparison (docs/recipe.md,
bench_recipe_losses.json): ``--steps 60 --jobs 3 --combos dpace+muon --losses ce lk_lambda tv@0.5
--live-temperatures 0 1 --out bench/results/bench_recipe_losses.json``.
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

import numpy as np
import torch

from dflash_cache import open_cache
from dflash_cache.runtime.config import load_config
from train.components.metrics import read_metrics
from train.loop.loop import train
from train.tools.evaluate import holdout_sample_ids, load_for_eval, teacher_forced_eval

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = ROOT / "configs" / "tiny.toml"
WEIGHTINGS = ("exp_decay", "dpace")
OPTIMIZERS = ("adamw", "muon")
ARCHS = ("dflash", "dflash2")  # a combination's optional third part: the drafter family
REFERENCE = "exp_decay+adamw"


def demo_cache(workdir: Path, config: str, final_hidden: bool = False) -> str:
    """The demo's cache: runs/demo/cache if a demo ran, else regenerate + extract once into ``workdir``.
    ``final_hidden``: a cache that also holds the teacher's final state (for the distribution losses)."""
    existing = ROOT / "runs" / "demo" / "cache"
    if (existing / "zarr.json").exists() and (not final_hidden or open_cache(str(existing)).spec.final_hidden):
        return str(existing)
    cache = workdir / ("cache-final" if final_hidden else "cache")
    if not (cache / "zarr.json").exists():
        from extract.cli import main as extract_main

        regenerated = workdir / "regenerated.jsonl"
        if not regenerated.exists() and extract_main(["regenerate", config, "--out", str(regenerated)]):
            raise SystemExit("regenerate failed (its error is printed above)")
        extra = ["--set", "cache.store_final_hidden=true"] if final_hidden else []
        if extract_main([config, "--data", str(regenerated), "--out", str(cache), *extra]):
            raise SystemExit("extract failed (its error is printed above)")
    return str(cache)


def loss_overrides(spec: str) -> list[str]:
    """``ce`` / ``kl`` / ``lk_lambda`` ... or ``LOSS@W`` (W x CE + (1-W) x LOSS) -> config overrides."""
    loss, _, weight = spec.partition("@")
    out = [f"train.loss={loss}"]
    return out + [f"train.loss_ce_weight={weight}"] if weight else out


def live_taus(cfg: Any, model: Any, cache: Any, ids: Any, temperatures: list[float], seed: int) -> dict[str, float]:
    """Live speculative decoding tau on the held-out prompts at each temperature (0: greedy, checked lossless;
    > 0: speculative sampling, seeded)."""
    from extract.teacher import load_teacher
    from train.tools.evaluate import live_eval, live_prompts
    from train.tools.sampling import SamplingParams

    teacher, tokenizer = load_teacher(cfg.teacher)
    prompts, _ = live_prompts(cache, ids, cfg.eval.live_prompts)
    eos = {int(t) for t in np.atleast_1d(teacher.generation_config.eos_token_id or tokenizer.eos_token_id)}
    out = {}
    for t in temperatures:
        res = live_eval(model, teacher, [p for _, p in prompts], max_new_tokens=cfg.eval.live_max_new_tokens, eos=eos,
                        layer_ids=list(cache.spec.target_layer_ids), sampling=SamplingParams(t), seed=seed)
        out[f"T={t:g}"] = res.tau
    return out


def run_one(config: str, overrides: list[str], cache_url: str, run_dir: Path,
            temperatures: list[float] | None = None) -> dict[str, Any]:
    """Train one combination; its held-out tau (and live taus at ``temperatures``) and the training loop's time."""
    torch.set_num_threads(1)  # the tiny drafter's ops are too small to split; threads only contend on 2 cores
    cfg = load_config(config, overrides)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    result = train(cfg, cache_url, run_dir)
    wall = time.perf_counter() - t0
    records = read_metrics(run_dir)
    cache = open_cache(cache_url)
    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction)
    model = load_for_eval(str(run_dir), cache, cfg.model.attention)
    tf = teacher_forced_eval(model, cache, ids)
    live = live_taus(cfg, model, cache, ids, temperatures, cfg.train.seed) if temperatures else {}
    return {
        "tau": tf.acceptance_length, "live_tau": live, "heldout_blocks": tf.n_blocks, "steps": result.step,
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
    ap.add_argument("--losses", nargs="*", default=None,
                    help="train.loss variants to cross with the combos: ce, kl, tv, lk_lambda, lk_alpha, or LOSS@W "
                    "(W x CE + (1-W) x LOSS); any but ce trains on a cache with the teacher's final state")
    ap.add_argument("--live-temperatures", type=float, nargs="*", default=None,
                    help="also score live speculative decoding tau on the held-out prompts at these temperatures "
                    "(0 = greedy; e.g. 0 1)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides for every run")
    ap.add_argument("--cache", help="the cache to train on (default: the demo's, see above)")
    ap.add_argument("--workdir", default="/tmp/bench_recipe", help="the run dirs, and the cache if built here")
    ap.add_argument("--out", default=str(RESULTS / "bench_recipe.json"))
    ap.add_argument("--reference", default=REFERENCE, help="the combination the paired tau differences are to")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    distribution = any(loss.partition("@")[0] != "ce" for loss in args.losses or [])
    cache_url = args.cache or demo_cache(workdir, args.config, final_hidden=distribution)
    combos = args.combos or [f"{w}+{o}" for w in WEIGHTINGS for o in OPTIMIZERS]
    if args.losses:
        combos = [f"{c}+{loss}" for c in combos for loss in args.losses]
    reference = combos[0] if args.losses else args.reference
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in combos}
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for combo in combos:
                weighting, optimizer, *rest = combo.split("+")  # then a drafter family and/or a loss
                arch = next((r for r in rest if r in ARCHS), "dflash")
                loss = [r for r in rest if r not in ARCHS]
                overrides = [f"train.max_steps={args.steps}", f"train.seed={seed}", f"model.arch={arch}",
                             f"train.loss_weighting={weighting}", f"train.optimizer={optimizer}",
                             *(loss_overrides(loss[0]) if loss else []),
                             "metrics.progress_bar=false", "metrics.tensorboard=false",
                             "eval.every_steps=1000000", f"checkpoint.every_steps={args.steps}", *args.overrides]
                run_dir = workdir / "runs" / f"{combo}-seed{seed}"
                futures.append((combo, seed, pool.submit(run_one, args.config, overrides, cache_url, run_dir,
                                                         args.live_temperatures)))
        for combo, seed, fut in futures:
            res = fut.result()
            res["seed"] = seed
            runs[combo].append(res)
            live = "  ".join(f"live {k} {v:.3f}" for k, v in res["live_tau"].items())
            print(f"{combo:>16} seed {seed}: tau {res['tau']:.3f}  {live}  loss {res['final_loss']:.3f}  "
                  f"train {res['train_wall_s']:.0f} s wall / {res['train_cpu_s']:.0f} s cpu  "
                  f"load {res['loadavg_1m_at_end']}", flush=True)
    summary: dict[str, Any] = {}
    for combo, rs in runs.items():
        entry = {"tau": summarize([r["tau"] for r in rs]),
                 "train_wall_s": summarize([r["train_wall_s"] for r in rs]),
                 "train_cpu_s": summarize([r["train_cpu_s"] for r in rs])}
        for key in rs[0]["live_tau"]:
            entry[f"live_tau_{key}"] = summarize([r["live_tau"][key] for r in rs])
        if reference in runs and combo != reference:
            entry["tau_minus_reference"] = summarize([r["tau"] - ref["tau"] for r, ref in zip(rs, runs[reference],
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
        f"seed against {reference}. live_tau_T=t: live speculative decoding on the held-out prompts (T=0 greedy, "
        "checked lossless; T>0 speculative sampling). train_cpu_s: training-thread CPU seconds (robust to other processes' load).",
    }
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

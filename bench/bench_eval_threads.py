"""``dflash-train eval --live`` on CPU with torch's default intra-op threads against the commands' thread
budget (``dflash_cache.runtime.threads.budget_cpu_threads``: the cores minus ``loader.num_readers``).

Set-up (once): the tiny teacher's features for the built-in conversations are extracted and a drafter is
trained for a few steps. Then the same ``dflash-train eval ... --live --json`` command (teacher-forced
acceptance on the held-out samples plus live speculative decoding with the tiny teacher) runs as a
subprocess, alternately with ``OMP_NUM_THREADS`` = torch's default (one thread per core: what the command
did before the budget) and without it (the budget), for ``--rounds`` interleaved rounds. Each run's
wall and CPU time (user + system of the child) is recorded with the 1-minute load average; the result
is the median and range per mode and the ratio default / budget of the medians.

    .venv/bin/python bench/bench_eval_threads.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
BIN = Path(sys.executable).parent
CONFIG = str(ROOT / "configs" / "tiny.toml")


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _env(threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def torch_default_threads() -> int:
    """torch's intra-op threads in a fresh process without OMP_NUM_THREADS."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=_env(None),
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def prepare(work: Path, samples: int, steps: int, holdout: float) -> list[str]:
    """Extract a cache and train a drafter in ``work``; returns the common --set overrides."""
    common = [f"data.path=builtin:tiny-chat?n={samples}", f"loader.holdout_fraction={holdout}"]
    subprocess.run([str(BIN / "dflash-extract"), CONFIG, "--out", str(work / "cache"), "--no-progress",
                    *_sets(*common)], env=_env(1), check=True, capture_output=True)
    subprocess.run([str(BIN / "dflash-train"), CONFIG, "--cache", str(work / "cache"), "--run-dir", str(work / "run"),
                    *_sets(*common, f"train.max_steps={steps}", "metrics.progress_bar=false",
                           "metrics.tensorboard=false")], env=_env(1), check=True, capture_output=True)
    return common


def run_eval(work: Path, sets: list[str], threads: int | None) -> dict:
    """One ``dflash-train eval --live`` with ``OMP_NUM_THREADS=threads`` (None: the budget)."""
    cmd = [str(BIN / "dflash-train"), "eval", CONFIG, "--cache", str(work / "cache"), "--checkpoint",
           str(work / "run"), "--live", "--json", "--device", "cpu", *_sets(*sets)]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout)
    budget = re.search(r"CPU compute: (\d+) intra-op thread", proc.stderr)  # logged when the budget changes it
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "loadavg_1m": load, "live_tau": report["live"]["tau"], "tf_tau": report["acceptance_length"],
            "threads": int(budget.group(1)) if budget else threads}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description="eval --live CPU time: torch's default threads vs the thread budget.")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs both modes)")
    ap.add_argument("--samples", type=int, default=64, help="built-in conversations extracted")
    ap.add_argument("--steps", type=int, default=30, help="training steps of the evaluated drafter")
    ap.add_argument("--prompts", type=int, default=4, help="eval.live_prompts")
    ap.add_argument("--new-tokens", type=int, default=64, help="eval.live_max_new_tokens")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_eval_threads.json", help="result file")
    args = ap.parse_args()

    default_threads = torch_default_threads()
    with tempfile.TemporaryDirectory(prefix="bench-eval-threads-") as tmp:
        work = Path(tmp)
        common = prepare(work, args.samples, args.steps, holdout=0.15)
        sets = [*common, f"eval.live_prompts={args.prompts}", f"eval.live_max_new_tokens={args.new_tokens}"]
        runs: dict[str, list[dict]] = {"default": [], "budget": []}
        for r in range(args.rounds):  # interleaved, the order alternating, so that load drifts hit both
            order = ["default", "budget"] if r % 2 == 0 else ["budget", "default"]
            for mode in order:
                runs[mode].append(run_eval(work, sets, default_threads if mode == "default" else None))
                print(f"round {r} {mode}: {runs[mode][-1]}", flush=True)
    res = {
        "command": "dflash-train eval configs/tiny.toml --cache CACHE --checkpoint RUN --live --json --device cpu",
        "settings": {"samples": args.samples, "train_steps": args.steps, "live_prompts": args.prompts,
                     "live_max_new_tokens": args.new_tokens, "rounds": args.rounds},
        "cpus": os.cpu_count(), "torch_default_threads": default_threads,
        "budget_threads": runs["budget"][0]["threads"] or default_threads,
        "default": {k: summary([x[k] for x in runs["default"]]) for k in ("wall_s", "cpu_s", "loadavg_1m")},
        "budgeted": {k: summary([x[k] for x in runs["budget"]]) for k in ("wall_s", "cpu_s", "loadavg_1m")},
        "runs": runs,
    }
    res["cpu_ratio_default_over_budget"] = res["default"]["cpu_s"]["median"] / res["budgeted"]["cpu_s"]["median"]
    res["wall_ratio_default_over_budget"] = res["default"]["wall_s"]["median"] / res["budgeted"]["wall_s"]["median"]
    res["same_tau"] = len({(x["live_tau"], x["tf_tau"]) for m in runs.values() for x in m}) == 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"eval --live on CPU, torch default ({default_threads} threads) / budget ({res['budget_threads']}): "
          f"CPU time {res['cpu_ratio_default_over_budget']:.2f}x, wall {res['wall_ratio_default_over_budget']:.2f}x "
          f"(medians of {args.rounds}; load {res['default']['loadavg_1m']['median']:.1f}); {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's train stage across seeds, intra-op thread counts and CPU kernel paths (a release check).

``make demo`` must train through on any machine: the kernel path (``ATEN_CPU_CAPABILITY``: the
instruction set torch's CPU kernels dispatch on; a CPU without AVX-512 takes ``avx2``) and the thread
count change the summation order inside the kernels, so the gradient-norm trajectory differs between
machines (on ``avx2`` the tiny preset's norm jumps ~15x around step 25, which stopped the run before the
guard accepted level shifts); ``torch.use_deterministic_algorithms(True)`` swaps in the deterministic
variants of the ops that have one. A variation is ``CAP`` or ``CAP+det``: ``CAP`` is an
``ATEN_CPU_CAPABILITY`` value (``avx512``, ``avx2``, ``default``: the scalar kernels) or ``native`` (unset:
the best the CPU has), ``+det`` turns deterministic algorithms on. Each child reports the capability and
thread count it ran with, so a variation the machine ignored shows. Each combination trains the tiny preset on the demo's cache for
its full schedule (the demo's ~500 steps; ``--steps N`` sets ``train.max_steps``, which also shortens the
lr schedule, so the trajectory differs from the demo's) through ``dflash-train`` and must finish (exit 0)
with a held-out acceptance length clearly above the untrained drafter's (``--min-gain``). Too slow for CI
(2-6 min per 100 steps at 1 thread on 2 busy cores, 10-25 min at 2 threads under ``nice``): run it before a release, after ``make demo`` has built the cache.

    .venv/bin/python bench/bench_demo_robustness.py [--cache runs/demo/cache] [--seeds 0,1,2] [--threads 1,2]
        [--variations native,avx2,avx2+det] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def untrained_tau(cache_url: str) -> float:
    from dflash_cache import open_cache
    from dflash_cache.runtime.config import load_config
    from train.demo import _untrained_drafter
    from train.tools.evaluate import holdout_sample_ids, teacher_forced_eval

    cfg = load_config(str(ROOT / "configs" / "tiny.toml"), [])
    cache = open_cache(cache_url)
    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction)
    return teacher_forced_eval(_untrained_drafter(cfg, cache), cache, ids, max_blocks=cfg.eval.max_blocks).acceptance_length


# the console script's own entry point, after the variation's torch switches; reports what the run got
CHILD = """import sys, torch
if sys.argv[1] == "det":
    torch.use_deterministic_algorithms(True)
print("variation: capability=%s threads=%d deterministic=%s" % (torch.backends.cpu.get_cpu_capability(),
      torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()), file=sys.stderr, flush=True)
from train.cli import main
sys.exit(main(sys.argv[2:]))
"""


def train_once(cache: str, run: Path, seed: int, threads: int, variation: str, steps: int) -> dict:
    from train.components.metrics import read_metrics

    cap, _, det = variation.partition("+")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cap != "native":
        env["ATEN_CPU_CAPABILITY"] = cap
    cmd = [sys.executable, "-c", CHILD, det or "-", str(ROOT / "configs" / "tiny.toml"), "--cache", cache, "--run-dir",
           str(run), *[a for s in (f"train.seed={seed}", *([f"train.max_steps={steps}", f"eval.every_steps={steps}"]
                                                           if steps else []),
                                   "metrics.progress_bar=false", "metrics.tensorboard=false") for a in ("--set", s)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    recs = read_metrics(run)
    evals = [r for r in read_metrics(run, kind="eval") if "eval/acceptance_length" in r]
    got = next((line.removeprefix("variation: ") for line in proc.stderr.splitlines()
                if line.startswith("variation: ")), None)
    return {"seed": seed, "threads": threads, "variation": variation, "ran_with": got, "exit_code": proc.returncode,
            "seconds": round(time.perf_counter() - t0, 1), "steps": len(recs),
            "skipped": sum(int(r.get("train/skipped", 0)) for r in recs),
            "rebaselines": max((int(r.get("train/guard_rebaselines", 0)) for r in recs), default=0),
            "tau": evals[-1]["eval/acceptance_length"] if evals else None,
            "error": proc.stderr[-600:] if proc.returncode else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default=str(ROOT / "runs" / "demo" / "cache"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--variations", default="native,avx2,avx2+det",
                   help="CAP or CAP+det, CAP an ATEN_CPU_CAPABILITY value or native (see above)")
    p.add_argument("--steps", type=int, default=0, help="train.max_steps (0: the preset's full schedule)")
    p.add_argument("--min-gain", type=float, default=1.0, help="tau must exceed the untrained drafter's by this")
    p.add_argument("--out", default=str(RESULTS / "bench_demo_robustness.json"))
    args = p.parse_args(argv)
    if not Path(args.cache).exists():
        print(f"no cache at {args.cache}: run `make demo` first (or pass --cache)", file=sys.stderr)
        return 2
    base = untrained_tau(args.cache)
    print(f"untrained tau {base:.3f}")
    runs: list[dict] = []
    grid = [(seed, threads, variation) for seed in (int(s) for s in args.seeds.split(","))
            for threads in (int(t) for t in args.threads.split(",")) for variation in args.variations.split(",")]
    with tempfile.TemporaryDirectory() as d:
        for seed, threads, variation in grid:  # seed outermost: a grid cut short still covers every variation
            r = train_once(args.cache, Path(d) / f"{variation}-{threads}-{seed}", seed, threads, variation, args.steps)
            r["ok"] = r["exit_code"] == 0 and r["tau"] is not None and r["tau"] > base + args.min_gain
            r["load_avg"] = round(os.getloadavg()[0], 1)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "error"}), flush=True)
            if r["error"]:
                print(r["error"], file=sys.stderr)
            out = {"untrained_tau": base, "steps": args.steps, "min_gain": args.min_gain, "planned": len(grid),
                   "runs": runs, "all_ok": len(runs) == len(grid) and all(r["ok"] for r in runs)}
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")  # after each run: a cut-short grid keeps its rows
    print(f"{sum(r['ok'] for r in runs)}/{len(runs)} runs trained through and beat the untrained drafter; "
          f"wrote {args.out}")
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

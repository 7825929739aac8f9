"""The loss-regression figures (tests/test_loss_regression.py) across CPU kernel paths and thread counts.

Each kernel path is a fresh process with ``ATEN_CPU_CAPABILITY`` set (``default``, ``avx2``, ``avx512``:
the instruction sets torch's CPU kernels dispatch on; a machine without AVX-512 takes ``avx2``), and runs
both recipes with 1 and 2 intra-op threads. Written: each run's per-step loss and grad norm, and the
largest relative deviation from the checked-in figures per recipe, key and step, so the test's tolerance
can be set from the measured spread.

    .venv/bin/python bench/bench_loss_spread.py [--paths default,avx2,avx512] [--threads 1,2]
    .venv/bin/python bench/bench_loss_spread.py --sensitivity   # real changes, against the same figures

``--sensitivity`` instead runs each recipe once (this process's kernel path, 1 thread) with small real
changes of the computation (lr x0.97, one anchor less, the loss weighting's parameter moved by 2%) and
writes the largest relative deviation each causes: the test's tolerance must stay below them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT / "tests"))


def _child(path: str, threads: list[int], out: Path) -> None:
    """In a process whose ATEN_CPU_CAPABILITY is set: every recipe at every thread count."""
    import torch
    from test_loss_regression import RUNS, build_cache, run_recipe

    with tempfile.TemporaryDirectory() as d:
        url = str(Path(d) / "cache")
        build_cache(url)
        res = {"capability": torch.backends.cpu.get_cpu_capability(), "runs": {}}
        for t in threads:
            for name, overrides in RUNS.items():
                res["runs"][f"{name}@{t}"] = run_recipe(url, Path(d) / f"{name}-{t}", overrides, threads=t)
    out.write_text(json.dumps(res))


PERTURBATIONS = {
    "exp_decay+adamw": {"lr x0.97": ["train.lr=2.91e-3"], "15 anchors": ["train.num_anchors=15"],
                        "loss_gamma 7 -> 6.86": ["train.loss_gamma=6.86"]},
    "dpace+muon+packing": {"muon_lr x0.97": ["train.muon_lr=2.91e-2"], "15 anchors": ["train.num_anchors=15"],
                           "dpace_alpha 0.5 -> 0.49": ["train.dpace_alpha=0.49"]},
}


def sensitivity(out_path: Path) -> None:
    from test_loss_regression import FIXTURE, KEYS, RUNS, build_cache, run_recipe

    fixture = json.loads(FIXTURE.read_text())
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        url = str(Path(d) / "cache")
        build_cache(url)
        for name, changes in PERTURBATIONS.items():
            for what, extra in changes.items():
                got = run_recipe(url, Path(d) / f"{name}-{what}".replace(" ", "_"), RUNS[name] + extra)
                out.setdefault(name, {})[what] = {
                    key: max(abs(v - w) / abs(w) for v, w in zip(got[key], fixture["runs"][name][key], strict=True))
                    for key in KEYS}
                print(f"{name:22s} {what:26s} " + "  ".join(f"{k} {v:.1e}" for k, v in out[name][what].items()))
    out_path.write_text(json.dumps({"load_avg": os.getloadavg()[0], "max_rel_dev": out}, indent=1) + "\n")
    print(f"wrote {out_path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default="default,avx2,avx512")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--sensitivity", action="store_true", help="real changes instead of kernel paths")
    p.add_argument("--out", default=str(RESULTS / "bench_loss_spread.json"))
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.sensitivity:
        sensitivity(RESULTS / "bench_loss_sensitivity.json")
        return 0
    if args.child:
        _child(os.environ.get("ATEN_CPU_CAPABILITY", "native"), threads, Path(args.child))
        return 0
    from test_loss_regression import FIXTURE, KEYS, RUNS

    fixture = json.loads(FIXTURE.read_text())
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        for path in args.paths.split(","):
            child_out = Path(d) / f"{path}.json"
            env = dict(os.environ, ATEN_CPU_CAPABILITY=path, OMP_NUM_THREADS="2")
            subprocess.run([sys.executable, __file__, "--child", str(child_out), "--threads", args.threads],
                           env=env, check=True, cwd=ROOT)
            got = json.loads(child_out.read_text())
            for key, vals in got["runs"].items():
                runs[f"{path}({got['capability']})/{key}"] = vals
    spread: dict[str, dict[str, list[float]]] = {}
    for name in RUNS:
        for key in KEYS:
            want = fixture["runs"][name][key]
            devs = [[abs(v - w) / abs(w) for v, w in zip(vals[key], want, strict=True)]
                    for run, vals in runs.items() if run.split("/")[1].startswith(name + "@")]
            spread.setdefault(name, {})[key] = [max(col) for col in zip(*devs, strict=True)]
    out = {"cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg()[0],
           "max_rel_dev_per_step": spread, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, keys in spread.items():
        for key, devs in keys.items():
            print(f"{name:22s} {key:16s} max rel dev per step: " + " ".join(f"{x:.1e}" for x in devs))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

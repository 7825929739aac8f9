"""The loss-regression figures (tests/test_loss_regression.py) across CPU kernel paths and thread counts.

Each kernel path is a fresh process with ``ATEN_CPU_CAPABILITY`` set (``default``, ``avx2``, ``avx512``:
the instruction sets torch's CPU kernels dispatch on; a machine without AVX-512 takes ``avx2``), and runs
both recipes with 1 and 2 intra-op threads. Written: each run's per-step loss and grad norm, and the
largest relative deviation from the checked-in figures per recipe, key and step, so the test's tolerance
can be set from the measured spread.

    .venv/bin/python bench/bench_loss_spread.py [--paths default,avx2,avx512] [--threads 1,2]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default="default,avx2,avx512")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "bench_loss_spread.json"))
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
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

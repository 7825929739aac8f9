"""Memory of in-process ``dflash-extract regenerate`` (tiny teacher, CPU) as the input grows: a generated
ShareGPT JSON array of N conversations (short questions, long answers: the answers are read and held but
never generated from) at 1x and 4x. The input is a stream regenerated a window at a time, so the Python heap
peak (tracemalloc, whole command) and the peak RSS must stay flat as N grows.

    python bench/bench_regenerate_memory.py [--n 400] [--sizes 1 4] [--rounds 1] [--set KEY=VALUE ...]

Each measurement is a fresh subprocess (``--one``) with the load average before it. With PYTHONPATH pointing
at another checkout it measures that code (``--no-window`` for one without ``regenerate.window``).
Writes bench/results/bench_regenerate_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_regenerate_memory.json"
ANSWER = "Rivers carry water, sediment and nutrients from the hills to the sea. " * 700  # ~50 KB, never a prompt


def make_data(path: Path, n: int) -> None:
    with path.open("w") as f:
        f.write("[\n")
        for i in range(n):
            conv = [{"from": "human", "value": f"Question {i}: why do rivers bend?"}, {"from": "gpt", "value": ANSWER}]
            if i % 2:
                conv += [{"from": "human", "value": "And lakes?"}, {"from": "gpt", "value": ANSWER}]
            f.write(("," if i else "") + json.dumps({"id": f"b{i}", "conversations": conv}) + "\n")
        f.write("]\n")


def one(args: argparse.Namespace) -> None:
    from extract.cli import main

    sets = [a for s in args.set for a in ("--set", s)]
    tracemalloc.start()
    t0 = time.perf_counter()
    rc = main(["regenerate", str(ROOT / "configs" / "tiny.toml"), "--data", args.data, "--out", args.out,
               "--no-progress", "--set", f"teacher.path={args.teacher}", *sets])
    wall = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(args.out) as f:
        written = sum(1 for _ in f)
    print(json.dumps({"rc": rc, "written": written, "tracemalloc_peak_mib": round(peak / 2**20, 1), "peak_rss_mib": round(rss, 1),
                      "wall_s": round(wall, 1)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--no-window", action="store_true", help="the code measured has no regenerate.window")
    p.add_argument("--label", default="streamed")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--teacher", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    from extract.tiny import build_tiny_teacher

    base = ["regenerate.max_new_tokens=1", "regenerate.batch_size=64"]
    if not args.no_window:
        base.append("regenerate.window=256")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        teacher = build_tiny_teacher(Path(tmp) / "teacher")
        for k in args.sizes:
            make_data(Path(tmp) / f"d{k}.json", args.n * k)
        for r in range(args.rounds):
            for k in args.sizes:
                data = Path(tmp) / f"d{k}.json"
                load = Path("/proc/loadavg").read_text().split()[0]
                cmd = [sys.executable, __file__, "--one", "--data", str(data), "--out", str(Path(tmp) / "o.jsonl"),
                       "--teacher", str(teacher), *[a for s in base + args.set for a in ("--set", s)]]
                res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
                if res.returncode:
                    raise SystemExit(res.stderr[-3000:])
                row = {"label": args.label, "round": r, "conversations": args.n * k,
                       "input_mib": round(data.stat().st_size / 2**20, 1), "load1": float(load),
                       **json.loads(res.stdout.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps([r for r in old if r["label"] != args.label] + rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

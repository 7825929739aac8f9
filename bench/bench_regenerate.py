"""The endpoint client of ``dflash-extract regenerate --endpoint``: its cost per request, and the speed-up
of N requests in flight over 1.

The server is tests/openai_server.py in its own process (a fixed reply; stdlib ``http.server``, so part
of each round trip is that server's own Python). Two set-ups, run in 3 interleaved rounds, each figure
reported as median and range with the load average at the time:

- instant replies, 1 in flight: wall time per request (client + loopback + server) and the client
  process's CPU time per request (its own overhead: JSON, HTTP, the output log, bookkeeping);
- a fixed 50 ms per request: requests/s with 1, 8 and 32 in flight; speed-up over 1 (ideal: N).

    .venv/bin/python bench/bench_regenerate.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_cache.runtime.config import load_config
from extract.endpoint import regenerate_via_endpoint

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
SERVED = "bench-model"
LATENCY_S = 0.05
CONCURRENCY = (1, 8, 32)


def start_server(latency_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "openai_server.py"), "--instant", "--latency-s",
                             str(latency_s), "--served-name", SERVED], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def run_client(url: str, n_conversations: int, concurrency: int, tmp: Path) -> dict[str, float]:
    out = tmp / f"out-{time.monotonic_ns()}.jsonl"
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"teacher.path={SERVED}", f"data.path=builtin:tiny-chat?n={n_conversations}",
                             f"regenerate.max_concurrency={concurrency}"])
    cfg.regenerate.endpoint = url
    cpu0, t0 = time.process_time(), time.perf_counter()
    report = regenerate_via_endpoint(cfg, str(out), show=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert report.complete and not report.failures, report.lines(str(out))
    return {"requests": report.n_requests, "wall_s": wall, "cpu_s": cpu, "rps": report.n_requests / wall,
            "loadavg_1m": os.getloadavg()[0]}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--instant-conversations", type=int, default=400)
    args = ap.parse_args()
    instant, instant_url = start_server(0.0)
    slow, slow_url = start_server(LATENCY_S)
    runs: dict[str, list[dict[str, float]]] = {"instant": []} | {f"latency_n{n}": [] for n in CONCURRENCY}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_regen_") as tmp:
            run_client(instant_url, 20, 1, Path(tmp))  # warm-up: imports, first connections
            for r in range(args.rounds):
                runs["instant"].append(run_client(instant_url, args.instant_conversations, 1, Path(tmp)))
                for n in CONCURRENCY:  # ~3 s of requests each at the ideal rate
                    runs[f"latency_n{n}"].append(run_client(slow_url, max(40, 50 * n), n, Path(tmp)))
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['rps']:.1f} req/s" for k, v in runs.items()),
                      flush=True)
    finally:
        for p in (instant, slow):
            p.terminate()
            p.wait()
    base = [x["rps"] for x in runs["latency_n1"]]
    res = {
        "server": "tests/openai_server.py (stdlib http.server, own process), fixed reply of 8 tokens",
        "rounds": args.rounds,
        "instant": {
            "requests_per_run": runs["instant"][0]["requests"],
            "round_trip_ms": summary([1e3 * x["wall_s"] / x["requests"] for x in runs["instant"]]),
            "client_cpu_ms_per_request": summary([1e3 * x["cpu_s"] / x["requests"] for x in runs["instant"]]),
        },
        "fixed_latency": {
            "latency_s": LATENCY_S,
            "requests_per_s": {str(n): summary([x["rps"] for x in runs[f"latency_n{n}"]]) for n in CONCURRENCY},
            # per round: rps(N) / rps(1) of the same round (interleaved, so both saw the same load)
            "speedup_over_1": {str(n): summary([x["rps"] / b for x, b in zip(runs[f"latency_n{n}"], base, strict=True)])
                               for n in CONCURRENCY[1:]},
        },
        "loadavg_1m": summary([x["loadavg_1m"] for v in runs.values() for x in v]),
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_regenerate.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""The endpoint client's transport against a well-kept library: stdlib ``http.client`` (one keep-alive
connection per thread, as ``extract.endpoint.ChatClient`` does) versus ``httpx.Client`` (one shared,
pooled client). Same requests (the body ``dflash-extract regenerate`` posts), same server
(tests/openai_server.py ``--instant`` in its own process), interleaved rounds:

- 1 in flight, instant replies: wall time and this process's CPU time per request;
- 8 threads in flight, 50 ms per reply: requests/s.

    .venv/bin/python bench/bench_http_client.py [--rounds 3] [--requests 400]

Needs ``httpx`` (not a dependency of the pipeline: ``pip install httpx``; without it the script says
skipped). Writes bench/results/bench_http_client.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
BODY = json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": "Say something. " * 20}],
                   "max_tokens": 64, "temperature": 0.0, "seed": 1}).encode()
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


def start_server(latency_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "openai_server.py"), "--instant", "--latency-s",
                             str(latency_s), "--served-name", "bench-model"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


class Stdlib:
    """What ChatClient._send does: a keep-alive HTTPConnection per thread."""

    def __init__(self, url: str):
        p = urlsplit(url)
        self.host, self.port, self.local = p.hostname, p.port, threading.local()

    def post(self) -> bytes:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=BODY, headers=HEADERS)
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, resp.status
        return data

    def close(self) -> None:
        pass


class Httpx:
    def __init__(self, url: str):
        import httpx

        self.url = url + "/v1/chat/completions"
        self.client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    def post(self) -> bytes:
        resp = self.client.post(self.url, content=BODY, headers=HEADERS)
        assert resp.status_code == 200, resp.status_code
        return resp.content

    def close(self) -> None:
        self.client.close()


def one_in_flight(kind, url: str, n: int) -> dict[str, float]:
    client = kind(url)
    client.post()  # connect
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        client.post()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    client.close()
    return {"wall_ms_per_request": 1e3 * wall / n, "cpu_ms_per_request": 1e3 * cpu / n}


def many_in_flight(kind, url: str, n: int, threads: int) -> float:
    client = kind(url)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: client.post(), range(threads)))  # connect
        t0 = time.perf_counter()
        list(pool.map(lambda _: client.post(), range(n)))
        rps = n / (time.perf_counter() - t0)
    client.close()
    return rps


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--out", type=Path, default=RESULTS / "bench_http_client.json")
    args = p.parse_args()
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("skipped: httpx is not importable (pip install httpx)")
        return 0
    instant, instant_url = start_server(0.0)
    slow, slow_url = start_server(0.05)
    runs: dict[str, dict[str, list[float]]] = {"stdlib": {}, "httpx": {}}
    loads = []
    try:
        for _ in range(args.rounds):
            for name, kind in (("stdlib", Stdlib), ("httpx", Httpx)):  # interleaved
                r = runs[name]
                one = one_in_flight(kind, instant_url, args.requests)
                for k, v in one.items():
                    r.setdefault(k, []).append(v)
                r.setdefault("rps_8_in_flight_50ms", []).append(many_in_flight(kind, slow_url, 4 * args.requests // 10, 8))
                loads.append(os.getloadavg()[0])
    finally:
        for proc in (instant, slow):
            proc.kill()
            proc.wait()
    out = {name: {k: summary(v) for k, v in r.items()} for name, r in runs.items()}
    out["loadavg_1m"] = summary(loads)
    out["rounds"] = args.rounds
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loader tokens/s from an object store vs local disk: the same cache, interleaved rounds.

    python bench/bench_object_store.py [--samples 400] [--hidden 512] [--rounds 3] [--epochs 1] [--no-s3]
        [--read-ahead-mib 1024 --in-flight 32 --max-request-mib 32] [--other-settings 256,16,64]

    # the figures of docs/performance.md (object storage): four epochs per round (the headline), then one
    python bench/bench_object_store.py --samples 2048 --bucket-edges "" --locality-parts 1 \
        --locality-run-samples 128 --epochs 4 --no-s3
    python bench/bench_object_store.py --samples 2048 --bucket-edges "" --locality-parts 1 \
        --locality-run-samples 128

Stores compared (every one reads the same cache, ``--epochs`` epochs per round, rounds interleaved):
- ``local``: the cache on local disk, read in place (loader.read_ahead = off: the default there);
- ``latency-0ms`` / ``latency-20ms``: ``latency://`` (dflash_cache.latency_fs) over the same files,
  every request waiting 0 or 20 ms and streaming at most ``--mbps`` MB/s (a per-connection cap);
  the loader's read-ahead is on (its default for any fsspec URL);
- ``s3``: a loopback moto S3 server (started here in a subprocess, stopped at the end) holding a
  copy of the cache, read through s3fs. moto copies the whole object for every range GET, so it
  measures the request pattern more than a real store's speed.

The stores' order rotates every round (round r starts with the r-th store), so none always runs first.
Reported per store: tokens/s (median [min-max] over rounds) and its ratio to local (the median [min-max]
of each round's ratio to local's tokens/s in the same round), feature range
requests per sample, read amplification (feature bytes fetched / stored feature bytes of the samples
read; > 1 when coalescing reads gaps, < 1 when a read-ahead block serves two epochs) and client CPU
seconds per GB of stored features read vs local, and the time from open to the first batch. With
``--epochs`` of 2 or more, also tokens/s over the epochs after the first (the loader open and its read-ahead
full, as through most of a long run; every store measured alike). The page cache
is warm (one untimed pass first).
Writes bench/results/bench_object_store.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import dflash_cache.latency_fs as latency_fs
from dflash_cache import open_cache
from dflash_cache.storage import FsspecStorage
from dflash_cache.synthetic import make_synthetic_cache
from train.config import LoaderConfig
from train.data.loader import StreamingLoader

BLOCKS = {"num_anchors": 512, "block_size": 16}


class RequestCount:
    """Requests the storage layer issues for remote stores (FsspecStorage), by kind (see latency_fs._kind):
    one call of get / get_range / read_into / get_suffix / list_dir / exists is one request."""

    def __init__(self) -> None:
        self.by_kind: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._saved = {}

    def __enter__(self) -> RequestCount:
        for name, verb in (("get", "get"), ("get_range", "get"), ("read_into", "get"), ("get_suffix", "get"),
                           ("list_dir", "list"), ("exists", "head")):
            orig = self._saved[name] = getattr(FsspecStorage, name)

            def counted(storage, key, *a, _orig=orig, _verb=verb, **kw):
                with self._lock:
                    self.by_kind[latency_fs._kind(f"{storage.root}/{key}", _verb)] += 1
                return _orig(storage, key, *a, **kw)

            setattr(FsspecStorage, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._saved.items():
            setattr(FsspecStorage, name, orig)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_epoch(url: str, readers: int, read_ahead: str, in_flight: int, locality: int | None = None,
              read_ahead_mib: int = 256, run_samples: int | None = None, max_request_mib: int = 64,
              epochs: int = 1) -> dict[str, float]:
    cfg = LoaderConfig(tokens_per_batch=16384, num_readers=readers, max_buffer_bytes=1 << 30, holdout_fraction=0.0,
                       read_ahead=read_ahead, requests_in_flight=in_flight, pin_memory=False,
                       locality_parts=locality, locality_run_samples=run_samples,
                       read_ahead_bytes=read_ahead_mib << 20, max_request_bytes=max_request_mib << 20)
    cache = open_cache(url)
    stored = {p.key: p.feature_bytes / max(p.n_tokens, 1) for p in cache.parts()}
    latency_fs.reset_counters()
    tokens = samples = 0
    used = 0.0
    with RequestCount() as count:
        t0, c0 = time.perf_counter(), _cpu()
        cache = open_cache(url)  # the loader's own, so that its requests are counted from the start
        first = None
        after_first: tuple[float, int] | None = None  # (time, tokens) when the first epoch ended
        with StreamingLoader(cache, cfg, **BLOCKS, seed=0, max_epochs=epochs) as loader:
            while loader.epoch < epochs:
                for b in loader:
                    if first is None:
                        first = time.perf_counter() - t0
                    tokens += b.n_tokens
                    samples += len(b.sample_ids)
                if after_first is None:
                    after_first = (time.perf_counter(), tokens)
            t_end = time.perf_counter()
            wall, cpu = t_end - t0, _cpu() - c0
            rc = loader.read_counters.as_dict()
            by_kind = dict(count.by_kind)
    index = cache.index()
    per_token = [stored[index.parts[int(p)].key] for p in index.part]
    used = epochs * float(sum(per_token[i] * int(index.lengths[i]) for i in range(len(per_token))))
    requests = rc["requests"] if read_ahead != "off" else None
    # the loader already open and its read-ahead full, as through most of a long run (epochs after the first)
    later = (None if epochs < 2 or after_first is None
             else (tokens - after_first[1]) / (t_end - after_first[0]))
    return {"tokens_per_s": tokens / wall, "later_epochs_tokens_per_s": later, "samples": samples,
            "tokens": tokens, "first_batch_s": first,
            "requests_per_sample": None if requests is None else requests / samples,
            "all_requests_per_sample": None if requests is None else sum(by_kind.values()) / samples,
            "requests_by_kind": by_kind,
            "read_amplification": None if requests is None else rc["bytes_fetched"] / used,
            "cpu_s_per_gb": cpu / (used / 1e9)}


def _per_round(rs: list[dict], local: list[dict], key: str) -> list[float]:
    """``key`` of each round over local's in the same round (the stores of a round run back to back, so a load
    that drifts through the run moves both alike; a ratio of medians would mix rounds)."""
    return [r[key] / ref[key] for r, ref in zip(rs, local, strict=True)]


def _later_epochs(rs: list[dict], local: list[dict]) -> dict[str, object]:
    """tokens/s over the epochs after the first (the loader open, its read-ahead full), median and range, and
    the median [range] of its per-round ratio to local's; nothing with one epoch per round."""
    vals = [r["later_epochs_tokens_per_s"] for r in rs]
    ref = [r["later_epochs_tokens_per_s"] for r in local]
    if None in vals or None in ref:
        return {}
    ratios = _per_round(rs, local, "later_epochs_tokens_per_s")
    return {"later_epochs_tokens_per_s_median": statistics.median(vals),
            "later_epochs_tokens_per_s_range": [min(vals), max(vals)],
            "later_epochs_vs_local": statistics.median(ratios), "later_epochs_vs_local_range": [min(ratios), max(ratios)],
            "later_epochs_vs_local_per_round": ratios}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start within 60 s")


def upload(local: str, port: int) -> str:
    import s3fs

    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    fs = s3fs.S3FileSystem(anon=False)
    fs.mkdir("bench")
    fs.put(local.rstrip("/") + "/", "bench/cache", recursive=True)
    return "s3://bench/cache"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=512, help="teacher hidden size (5 layers captured)")
    ap.add_argument("--median-length", type=int, default=256)
    ap.add_argument("--samples-per-part", type=int, default=128)
    ap.add_argument("--bucket-edges", default="256,512,1024,2048",
                    help="length bucket edges ('' for one bucket: every part but the last is full)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1, help="epochs per round and store (one open, one loader)")
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--locality-parts", type=int, default=None,
                    help="loader.locality_parts for every store (the same plan for all)")
    ap.add_argument("--locality-run-samples", type=int, default=None, help="loader.locality_run_samples")
    ap.add_argument("--read-ahead-mib", type=int, default=1024)
    ap.add_argument("--max-request-mib", type=int, default=32, help="loader.max_request_bytes in MiB")
    ap.add_argument("--other-settings", default=None, metavar="MIB,IN_FLIGHT,REQUEST_MIB",
                    help="also time the latency:// stores with these read-ahead settings (e.g. 256,16,64)")
    ap.add_argument("--mbps", type=float, default=100.0, help="bandwidth cap per request stream of latency://")
    ap.add_argument("--no-s3", action="store_true", help="skip the loopback moto S3 server")
    ap.add_argument("--workdir", default="/tmp/bench_object_store")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "bench_object_store.json"))
    args = ap.parse_args(argv)

    load_start = os.getloadavg()[0]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    local = str(work / "cache")
    make_synthetic_cache(local, n_samples=args.samples, hidden_size=args.hidden, num_layers=8,
                         target_layer_ids=(1, 2, 3, 4, 5), median_length=args.median_length, max_length=3072,
                         min_length=32, bucket_edges=tuple(int(e) for e in args.bucket_edges.split(',') if e), samples_per_part=args.samples_per_part,
                         chunk_tokens=256, shard_tokens=16384, with_head=False, seed=1)
    stores = {"local": (local, "off", None), "latency-0ms": (f"latency://{local}", "auto", 0.0),
              "latency-20ms": (f"latency://{local}", "auto", 20.0)}
    other = None
    if args.other_settings:  # the latency:// stores again with other read-ahead settings, in the same rounds
        other = tuple(int(v) for v in args.other_settings.split(","))
        for ms in (0, 20):
            stores[f"latency-{ms}ms (other settings)"] = (f"latency://{local}", "auto", float(ms))
    moto = None
    try:
        if not args.no_s3:
            port = _free_port()
            moto = start_moto(port)
            stores["s3"] = (upload(local, port), "auto", None)
        os.sync()  # the cache's dirty pages written out before timing: a flush would compete with the rounds
        one_epoch(local, args.readers, "off", args.in_flight, args.locality_parts,
                  run_samples=args.locality_run_samples)  # warm the page cache
        runs: dict[str, list[dict]] = {k: [] for k in stores}
        names = list(stores)
        for r in range(args.rounds):
            # the order rotates each round: under a load that rises or falls through a run, a fixed order (local
            # first) tilts every store's ratio the same way
            order = names[r % len(names):] + names[:r % len(names)]
            for position, name in enumerate(order):
                url, mode, ms = stores[name]
                if ms is not None:
                    latency_fs.configure(ms, args.mbps)
                mib, in_flight, req = other if name.endswith(" (other settings)") else (
                    args.read_ahead_mib, args.in_flight, args.max_request_mib)
                res = one_epoch(url, args.readers, mode, in_flight, args.locality_parts, mib,
                                args.locality_run_samples, req, args.epochs)
                runs[name].append({**res, "round": r, "position": position})
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=30)
    load = os.getloadavg()[0]

    def read_ahead_of(name: str) -> str:
        return stores[name][1]

    local = runs["local"]
    table = {}
    print(f"{'store':14s} {'tokens/s median [range]':>30s} {'vs local, per round':>19s} {'feature req/sample':>22s} "
          f"{'all req/sample':>20s} {'read amp':>9s} {'CPU vs local':>12s} {'first batch s':>20s}")

    def spread(rs: list[dict], key: str, fmt: str) -> str:
        vals = [r[key] for r in rs if r[key] is not None]
        if not vals:
            return "-"
        return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"

    for name, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        med = statistics.median(tps)
        ratios = _per_round(rs, local, "tokens_per_s")
        row = {"tokens_per_s_median": med, "tokens_per_s_range": [min(tps), max(tps)],
               "vs_local": statistics.median(ratios), "vs_local_range": [min(ratios), max(ratios)],
               "vs_local_per_round": ratios, **_later_epochs(rs, local),
               "requests_per_sample": rs[-1]["requests_per_sample"],
               "all_requests_per_sample": rs[-1]["all_requests_per_sample"],
               "requests_by_kind": rs[-1]["requests_by_kind"], "read_amplification": rs[-1]["read_amplification"],
               "cpu_per_byte_vs_local": statistics.median(_per_round(rs, local, "cpu_s_per_gb")),
               "first_batch_s_median": statistics.median(r["first_batch_s"] for r in rs), "rounds": rs}
        table[name] = row
        print(f"{name:14s} {med:12.0f} [{min(tps):.0f}-{max(tps):.0f}] "
              f"{row['vs_local']:5.2f} [{min(ratios):.2f}-{max(ratios):.2f}] "
              f"{spread(rs, 'requests_per_sample', '.3f'):>22s} {spread(rs, 'all_requests_per_sample', '.3f'):>20s} "
              f"{spread(rs, 'read_amplification', '.2f'):>9s} {row['cpu_per_byte_vs_local']:12.2f} "
              f"{spread(rs, 'first_batch_s', '.2f'):>20s}")
        if row.get("later_epochs_vs_local") is not None:
            lt = [r["later_epochs_tokens_per_s"] for r in rs]
            lr = row["later_epochs_vs_local_range"]
            print(f"{'':14s} epochs after the first: {statistics.median(lt):.0f} [{min(lt):.0f}-{max(lt):.0f}] "
                  f"tokens/s, {row['later_epochs_vs_local']:.2f}x [{lr[0]:.2f}-{lr[1]:.2f}] local")
        if row["requests_by_kind"] and read_ahead_of(name) != "off":
            print(f"{'':14s} requests by kind (last round): {row['requests_by_kind']}")
    print(f"load average {load_start:.1f} at the start, {load:.1f} at the end; {args.samples} samples, {rs[-1]['tokens']} tokens, width 5x{args.hidden}, "
          f"{args.readers} readers, {args.in_flight} requests in flight, read-ahead {args.read_ahead_mib} MiB, "
          f"requests of at most {args.max_request_mib} MiB, "
          f"locality_parts {args.locality_parts} (runs of {args.locality_run_samples}), latency:// cap {args.mbps} MB/s per stream"
          + (f"; other settings (read-ahead MiB, in flight, request MiB): {args.other_settings}" if other else ""))
    out = {"settings": vars(args), "load_average": load, "load_average_start": load_start, "stores": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

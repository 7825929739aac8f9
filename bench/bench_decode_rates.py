"""Feature decode rate per reader core, for every codec, through the loader: what `dflash-extract estimate`
uses to size reader cores (extract/estimate.py, DECODE_GBPS_PER_CORE).

    python bench/bench_decode_rates.py [--tokens 40000] [--rounds 3]

One synthetic cache at the 27B teacher's width (5 layers x 5120: 51,200 B/token in bf16) is written once
per codec from the same features. Each round times one epoch of every codec's cache with one reader
(after one untimed warm-up epoch each; the page cache is warm), codecs interleaved. The figure is feature
GB delivered (bf16: 51,200 B/token at the default width) per CPU-second of this process: robust to other jobs on the machine,
unlike tokens/s. Prints median [range] over the rounds and writes bench/results/bench_decode_rates.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from dflash_cache import create_cache, open_cache
from dflash_cache.synthetic import make_synthetic_cache
from train.config import LoaderConfig
from train.data.loader import StreamingLoader

CODECS = ("bf16-raw", "bf16-zstd", "bf16-lz4", "fp8-e4m3")


def build(work: Path, n_tokens: int, hidden: int) -> dict[str, str]:
    first = str(work / "bf16-zstd")
    n = max(8, n_tokens // 600)
    cache = make_synthetic_cache(first, n_samples=n, hidden_size=hidden, num_layers=64,
                                 target_layer_ids=(1, 16, 31, 46, 61), vocab_size=1024, median_length=600,
                                 max_length=3072, bucket_edges=(256, 512, 1024, 2048), chunk_tokens=256,
                                 shard_tokens=16384, samples_per_part=64, with_head=False)
    urls = {"bf16-zstd": first}
    for codec in CODECS:
        if codec in urls:
            continue
        urls[codec] = str(work / codec)
        copy = create_cache(urls[codec], dataclasses.replace(cache.spec, codec=codec), chunk_tokens=256,
                            shard_tokens=16384)
        for part in cache.parts():
            with copy.part_writer(part.bucket, part.name) as w:
                for s in cache.read_rows(part, range(part.n_samples)):
                    w.add(s.sample_id, s.input_ids, s.loss_mask, s.features)
    return urls


def one_epoch(url: str, bytes_per_token: int) -> dict[str, float]:
    cfg = LoaderConfig(tokens_per_batch=16384, num_readers=1, max_buffer_bytes=2 << 30, holdout_fraction=0.0,
                       pin_memory=False)
    with StreamingLoader(open_cache(url), cfg, seed=0, num_anchors=512, block_size=16, max_epochs=1) as loader:
        t0, c0, tokens = time.perf_counter(), time.process_time(), 0
        for b in loader:
            tokens += b.n_tokens
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gb = tokens * bytes_per_token / 1e9
    return {"tokens": tokens, "gb_per_cpu_s": gb / cpu, "gb_per_s": gb / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=5120, help="teacher hidden size (5 layers captured)")
    ap.add_argument("--workdir", default="/tmp/bench_decode_rates")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "bench_decode_rates.json"))
    args = ap.parse_args(argv)
    load_start = os.getloadavg()[0]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    urls = build(work, args.tokens, args.hidden)
    per_token = 5 * args.hidden * 2
    stored = {c: sum(f.stat().st_size for f in Path(u).rglob("*") if f.is_file()) for c, u in urls.items()}
    for url in urls.values():
        one_epoch(url, per_token)  # warm-up: page cache, imports, thread pools
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CODECS}
    for _ in range(args.rounds):
        for codec in CODECS:
            runs[codec].append(one_epoch(urls[codec], per_token))
    load_end = os.getloadavg()[0]
    table = {}
    print(f"{'codec':10s} {'feature GB per CPU-second, median [range]':>42s} {'stored / raw':>13s}")
    for codec in CODECS:
        rates = [r["gb_per_cpu_s"] for r in runs[codec]]
        table[codec] = {"gb_per_cpu_s_median": statistics.median(rates), "gb_per_cpu_s": rates,
                        "stored_bytes": stored[codec], "stored_over_raw": stored[codec] / stored["bf16-raw"]}
        print(f"{codec:10s} {statistics.median(rates):>26.2f} [{min(rates):.2f}-{max(rates):.2f}] "
              f"{stored[codec] / stored['bf16-raw']:>13.3f}")
    tokens = runs[CODECS[0]][0]["tokens"]
    print(f"load average {load_start:.1f} at the start, {load_end:.1f} at the end; {tokens} tokens per epoch, "
          f"1 reader, width 5x{args.hidden}, {args.rounds} interleaved rounds")
    out = {"settings": vars(args), "load_average_start": load_start, "load_average_end": load_end,
           "tokens_per_epoch": tokens, "codecs": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

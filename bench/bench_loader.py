"""Loader benchmark: plan padding, plan time, loader throughput vs one torch.save file per sample.

All figures come from one run over the same synthetic cache: realistic long-tailed lengths
(log-normal, 50-3000 tokens) and the 27B teacher's width (5 layers x 5120 = 51,200 B/token).

    python bench/bench_loader.py [--tokens 32000] [--rounds 3] [--epochs 3] [--workdir /tmp/bench_loader]

Prints a table and writes bench/results/bench_loader.json: every configuration once per round, the order
rotated each round, each figure the median [range] over rounds, each ratio taken within a round. The page cache is warm for every
timed pass (one untimed pass first), so this measures the CPU cost of reading, not the disk.
The per-sample-file baseline is a standard torch DataLoader (0 or 2 worker processes) over the
same plan's batches, collated by the same function. The machine may be shared: the load average
is recorded, and configurations run interleaved so that ratios stay comparable.
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
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dflash_cache import create_cache, open_cache
from dflash_cache.synthetic import make_synthetic_cache, synthetic_lengths
from train.config import LoaderConfig
from train.data.assemble import collate
from train.data.loader import StreamingLoader
from train.data.plan import PlanSettings, build_plan

EDGES = (256, 512, 1024, 2048)
TARGET_GBPS = 26_000 * 51_200 / 1e9  # 26 Ktok/s of 27B-teacher features


def _lengths(n: int, seed: int) -> np.ndarray:
    return synthetic_lengths(n, np.random.default_rng(seed), 50, 3000, 400)


def random_batches_padding(lengths: np.ndarray, budget: int, seed: int) -> float:
    """Random shuffle, then greedy pad-to-longest batches within the token budget."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    padded = real = 0
    rows, longest = 0, 0
    for n in lengths[order].tolist():
        if (rows + 1) * max(longest, n) > budget:
            padded += rows * longest
            rows, longest = 0, 0
        rows, longest, real = rows + 1, max(longest, n), real + n
    padded += rows * longest
    return 1 - real / padded


def bench_plan(n: int, budget: int) -> dict:
    lengths = _lengths(n, 0)
    ids = np.arange(n, dtype=np.int64)
    buckets = np.searchsorted(EDGES, lengths, side="left")
    out = {"n_samples": n, "tokens_per_batch": budget, "random_shuffle_padding": random_batches_padding(lengths, budget, 0)}
    for packing in (False, True):
        s = PlanSettings(seed=0, num_anchors=512, block_size=16, tokens_per_batch=budget, packing=packing,
                         row_tokens=4096 if packing else None)
        t0 = time.perf_counter()
        plan = build_plan(ids, lengths, buckets, s, epoch=0)
        key = "packed" if packing else "padded"
        out[f"plan_{key}_seconds"] = time.perf_counter() - t0
        out[f"plan_{key}_padding"] = plan.stats.padding_fraction
    return out


def build_caches(work: Path, n_tokens: int) -> tuple[str, str, list[int]]:
    lengths = _lengths(4 * n_tokens // 400, 1)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), n_tokens)) + 1]
    zstd = str(work / "cache-zstd")
    cache = make_synthetic_cache(zstd, n_samples=len(lengths), lengths=lengths.tolist(), hidden_size=5120,
                                 num_layers=64, target_layer_ids=(1, 16, 31, 46, 61), vocab_size=1024,
                                 max_length=3072, bucket_edges=EDGES, chunk_tokens=256, shard_tokens=16384,
                                 samples_per_part=64, with_head=False)
    raw = str(work / "cache-raw")
    copy = create_cache(raw, dataclasses.replace(cache.spec, codec="bf16-raw"), chunk_tokens=256, shard_tokens=16384)
    for part in cache.parts():
        with copy.part_writer(part.bucket, part.name) as w:
            for s in cache.read_rows(part, range(part.n_samples)):
                w.add(s.sample_id, s.input_ids, s.loss_mask, s.features)
    return zstd, raw, lengths.tolist()


def write_sample_files(cache_url: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cache = open_cache(cache_url)
    for part in cache.parts():
        for s in cache.read_rows(part, range(part.n_samples)):
            torch.save({"input_ids": s.input_ids, "loss_mask": s.loss_mask, "features": s.features.clone()},
                       out / f"{s.sample_id}.pt")


class SampleFiles(Dataset):
    def __init__(self, root: Path):
        self.root = root

    def __len__(self) -> int:
        return len(list(self.root.iterdir()))

    def __getitem__(self, sample_id: int) -> dict:
        return torch.load(self.root / f"{sample_id}.pt", weights_only=True)


def _pad_collate(items: list[dict]) -> dict:
    return collate([[SimpleNamespace(**d)] for d in items], items[0]["features"].shape[1])


def _loader_cfg(budget: int, readers: int) -> LoaderConfig:
    return LoaderConfig(tokens_per_batch=budget, num_readers=readers, max_buffer_bytes=3 << 30, holdout_fraction=0)


def time_loader(url: str, budget: int, readers: int, epochs: int) -> tuple[float, float, float]:
    """(tokens/s, feature GB/s, feature GB per CPU-second of this process) over ``epochs`` timed epochs
    after one warm-up epoch."""
    with StreamingLoader(open_cache(url), _loader_cfg(budget, readers), seed=0, num_anchors=512, block_size=16,
                         max_epochs=epochs + 1) as loader:
        for _ in loader:
            pass
        t0, c0, tokens, nbytes = time.perf_counter(), time.process_time(), 0, 0
        while loader.epoch < epochs + 1:
            for b in loader:
                tokens += b.n_tokens
                nbytes += b.n_tokens * b.features.shape[-1] * 2
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return tokens / dt, nbytes / dt / 1e9, nbytes / cpu / 1e9


def time_files(root: Path, url: str, budget: int, workers: int, epochs: int) -> tuple[float, float, float | None]:
    """The same plan's batches read from per-sample torch.save files by a standard DataLoader:
    (tokens/s, feature GB/s, GB per CPU-second: only without worker processes, whose time is not ours)."""
    cache = open_cache(url)
    idx = cache.index()
    s = PlanSettings(seed=0, num_anchors=512, block_size=16, tokens_per_batch=budget)
    plan = build_plan(idx.sample_ids, idx.lengths, idx.buckets, s, epoch=0)
    batches = [idx.sample_ids[b.positions].tolist() for b in plan.batches]
    dim = cache.spec.feature_dim
    dl = DataLoader(SampleFiles(root), batch_sampler=batches, num_workers=workers, collate_fn=_pad_collate,
                    persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
    for _ in dl:  # warm-up pass
        pass
    t0, c0, tokens = time.perf_counter(), time.process_time(), 0
    for _ in range(epochs):
        for b in dl:
            tokens += int((b["doc_ids"] >= 0).sum())
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return tokens / dt, tokens * dim * 2 / dt / 1e9, tokens * dim * 2 / cpu / 1e9 if workers == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32_000, help="tokens in the synthetic cache")
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per configuration and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every configuration once each)")
    ap.add_argument("--workdir", default="/tmp/bench_loader")
    ap.add_argument("--keep", action="store_true", help="keep the caches and files")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    res: dict = {"cpu_cores": os.cpu_count(), "bytes_per_token": 51_200, "target_gbps": TARGET_GBPS,
                 "load_avg_start": os.getloadavg()[0]}
    res["plan"] = bench_plan(100_000, 16_384)
    t0 = time.perf_counter()
    zstd, raw, lengths = build_caches(work, args.tokens)
    write_sample_files(zstd, work / "files")
    res["cache"] = {"samples": len(lengths), "tokens": int(sum(lengths)), "build_s": time.perf_counter() - t0,
                    "zstd_bytes": _du(work / "cache-zstd"), "raw_bytes": _du(work / "cache-raw"),
                    "files_bytes": _du(work / "files")}
    configs = {f"files_dataloader_{w}w": (time_files, (work / "files", zstd, args.tokens_per_batch, w, args.epochs))
               for w in (0, 2)}
    for n in (1, 2):
        for name, url in (("zstd", zstd), ("raw", raw)):
            configs[f"loader_{name}_{n}r"] = (time_loader, (url, args.tokens_per_batch, n, args.epochs))
    names = list(configs)
    rounds: list[dict] = []
    for r in range(args.rounds):
        # every configuration once per round, the order rotated each round: a load that drifts through the
        # run (other jobs on a shared machine) favours no configuration, and each ratio is taken within a round
        order = names[r % len(names):] + names[:r % len(names)]
        row = {"order": order, "load_avg": os.getloadavg()[0]}
        for name in order:
            fn, fargs = configs[name]
            tps, gbps, per_cpu = fn(*fargs)
            row[name] = {"tokens_per_s": tps, "feature_gbps": gbps, "gb_per_cpu_s": per_cpu}
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds}, load {row['load_avg']:.1f}: "
              + ", ".join(f"{k} {row[k]['tokens_per_s']:.0f}" for k in names), flush=True)
    res["rounds"] = rounds
    res["throughput"] = {k: {m: _spread([x[k][m] for x in rounds]) for m in ("tokens_per_s", "feature_gbps",
                                                                             "gb_per_cpu_s")} for k in names}
    # GB per CPU-second of one reader: robust to load
    per_core = {k: _spread([x[f"loader_{k}_1r"]["gb_per_cpu_s"] for x in rounds]) for k in ("zstd", "raw")}
    res["per_core_gbps"] = per_core
    res["cores_for_target"] = {k: TARGET_GBPS / v["median"] for k, v in per_core.items()}
    for files, n in (("files_dataloader_2w", 2), ("files_dataloader_0w", 1)):
        res[f"ratio_vs_files_{files[-2]}"] = {
            k: _spread([x[f"loader_{k}_{n}r"]["tokens_per_s"] / x[files]["tokens_per_s"] for x in rounds])
            for k in ("zstd", "raw")}
    res["load_avg_end"] = os.getloadavg()[0]
    _print(res)
    out = Path(__file__).parent / "results" / "bench_loader.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def _spread(vals: list[float | None]) -> dict | None:
    """median, [min, max] and the values, over rounds (None where a configuration has no such figure)."""
    if any(v is None for v in vals):
        return None
    return {"median": statistics.median(vals), "range": [min(vals), max(vals)], "values": vals}


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _print(res: dict) -> None:
    p = res["plan"]
    print(f"plan, {p['n_samples']} samples, {p['tokens_per_batch']} tokens/batch:")
    print(f"  padding: random shuffle {p['random_shuffle_padding']:.1%}, plan padded {p['plan_padded_padding']:.2%}, "
          f"plan packed {p['plan_packed_padding']:.2%}; plan time {p['plan_padded_seconds']:.2f} s / "
          f"{p['plan_packed_seconds']:.2f} s")
    c = res["cache"]
    print(f"cache: {c['samples']} samples, {c['tokens']} tokens; zstd {c['zstd_bytes'] / 1e9:.2f} GB, "
          f"raw {c['raw_bytes'] / 1e9:.2f} GB, per-sample files {c['files_bytes'] / 1e9:.2f} GB")
    print("  (per CPU-s: feature GB per second of this process's CPU time, all threads)")
    n = len(res["rounds"])
    print(f"  median [range] over {n} interleaved rounds; per CPU-s: feature GB per second of this process's CPU "
          "time, all threads")
    for k, v in res["throughput"].items():
        t, g, c = v["tokens_per_s"], v["feature_gbps"], v["gb_per_cpu_s"]
        cpu = f"{c['median']:6.2f} GB per CPU-s" if c else ""
        print(f"  {k:24s} {t['median']:8.0f} [{t['range'][0]:.0f}-{t['range'][1]:.0f}] tok/s  "
              f"{g['median']:6.2f} GB/s  {cpu}")
    for k, v in res["per_core_gbps"].items():
        r0, r2 = res["ratio_vs_files_0"][k], res["ratio_vs_files_2"][k]
        print(f"per core ({k}, 1 reader, GB per CPU-s): {v['median']:.2f} -> {res['cores_for_target'][k]:.1f} cores "
              f"for {res['target_gbps']:.2f} GB/s; tokens/s vs files, each round's ratio: 1 reader / 0 workers "
              f"{r0['median']:.2f}x [{r0['range'][0]:.2f}-{r0['range'][1]:.2f}], 2 readers / 2 workers "
              f"{r2['median']:.2f}x [{r2['range'][0]:.2f}-{r2['range'][1]:.2f}]")
    loads = [x["load_avg"] for x in res["rounds"]]
    print(f"load average {res['load_avg_start']:.1f} at the start, {min(loads):.1f}-{max(loads):.1f} at the rounds' "
          f"starts, {res['load_avg_end']:.1f} at the end, on {res['cpu_cores']} cores")


if __name__ == "__main__":
    main()

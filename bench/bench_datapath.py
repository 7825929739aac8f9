"""Data-path benchmark: start-up of index, plan and loader against the number of samples.

    python bench/bench_datapath.py [--disk 100000,1000000] [--memory 100000,1000000,3000000,10000000]

Three measurements, each in a fresh subprocess (so that its peak RSS is its own), interleaved over the
sizes, ``--runs`` times (median and range reported, with the load average before each run):

- **disk**: a real synthetic cache on local disk (realistic lengths: log-normal, median 800, 50..3072;
  ~1000 samples per part; features 8 wide and zero, so that building 1M samples takes minutes, not
  hours: start-up reads only the small arrays, whose sizes are realistic). ``loader``: open the cache,
  construct a real :class:`StreamingLoader` (part listing, index, part selection, epoch-0 plan) and take
  its first batch. ``train``: the same plus ``epoch_lengths(6)`` before the first batch, as ``train()``
  does (6 epochs planned, kept, and read later).
- **memory**: the same steps on in-memory index arrays (a real ``CacheIndex`` of the sizes, no files):
  part selection (all parts, and half of them as a live window does), the planner (canonical order,
  holdout, digest) and 6 epoch plans, kept as the loader keeps them. This is how 10M samples are measured
  without a 10M-sample cache on disk; the disk part of a 10M start-up (part listing and index reads, O(parts))
  is extrapolated linearly from the largest disk cache, and stated so.
- **preset**: for the qwen3-8b preset's settings (tokens_per_batch 16384, num_anchors 512, block_size 16)
  over a realistic 100k-sample plan: block positions per batch (median / max) and steps per epoch with
  loader.max_block_positions = 65536 and without a block budget (the behaviour before the budget).

Writes bench/results/bench_datapath.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash_cache import create_cache, open_cache
from dflash_cache.index import CacheIndex
from dflash_cache.parts import PartInfo
from dflash_cache.spec import CacheSpec, TeacherInfo
from dflash_cache.synthetic import synthetic_lengths
from train.config import LoaderConfig
from train.data.loader import StreamingLoader, select_parts
from train.data.plan import Planner, PlanSettings

EDGES = (256, 512, 1024, 2048)
MAX_LENGTH = 3072
PER_PART = 1000
EPOCHS = 6
ANCHORS, BLOCK = 512, 16  # the qwen3-8b preset
CFG = LoaderConfig(tokens_per_batch=16384, num_readers=2, max_buffer_bytes=64 << 20, holdout_fraction=0.02)


def _lengths(n: int) -> np.ndarray:
    return synthetic_lengths(n, np.random.default_rng(0), 50, MAX_LENGTH, 800)


def _layout(n: int) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """Lengths, and the samples of each part: by bucket, ~PER_PART per part."""
    lengths = _lengths(n)
    buckets = np.searchsorted(EDGES, lengths, side="left")
    parts = []
    for b in range(len(EDGES) + 1):
        members = np.flatnonzero(buckets == b)
        parts.extend((b, members[k:k + PER_PART]) for k in range(0, len(members), PER_PART))
    return lengths, parts


def build_cache(url: str, n: int) -> dict:
    os.environ["DFLASH_CACHE_FSYNC"] = "0"  # a scratch cache: atomic commits, no fsync (the disk is shared)
    spec = CacheSpec(teacher=TeacherInfo("synthetic", None, 4, 8, 1024, "bfloat16"), target_layer_ids=[1],
                     tokenizer_hash="synthetic", max_length=MAX_LENGTH, codec="bf16-zstd", bucket_edges=list(EDGES),
                     dataset_fingerprint=f"bench-datapath-{n}")
    cache = create_cache(url, spec, chunk_tokens=256, shard_tokens=16384)
    lengths, parts = _layout(n)
    t0 = time.perf_counter()
    for k, (b, members) in enumerate(parts):
        lens = lengths[members]
        total = int(lens.sum())
        with cache.part_writer(b, f"p{k:06d}") as w:
            mask = np.ones(total, dtype=bool)
            w.add_batch(members, lens, np.zeros(total, np.int32), mask,
                        torch.zeros(total, spec.feature_dim, dtype=torch.bfloat16))
    return {"samples": n, "parts": len(parts), "tokens": int(lengths.sum()), "build_s": time.perf_counter() - t0}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_disk(url: str, mode: str) -> dict:
    """Time to the first batch of a real loader over the cache at ``url`` (this process's imports excluded)."""
    rss0 = _peak_rss_mb()
    t0 = time.perf_counter()
    cache = open_cache(url)
    with StreamingLoader(cache, CFG, seed=0, num_anchors=ANCHORS, block_size=BLOCK, max_epochs=EPOCHS) as loader:
        t_init = time.perf_counter() - t0
        steps = loader.epoch_lengths(EPOCHS) if mode == "train" else None
        t_lengths = time.perf_counter() - t0 - t_init
        batch = next(iter(loader))
        total = time.perf_counter() - t0
        assert batch.n_tokens > 0
    out = {"first_batch_s": total, "init_s": t_init, "epoch_lengths_s": t_lengths,
           "peak_rss_mb": _peak_rss_mb(), "rss_after_imports_mb": rss0, "steps_per_epoch": steps}
    if mode == "loader":  # where the time goes (measured again, after the loader)
        t = time.perf_counter()
        parts = cache.parts()
        out["parts_listing_s"] = time.perf_counter() - t
        t = time.perf_counter()
        cache.index()
        out["index_s"] = time.perf_counter() - t
        out["n_parts"] = len(parts)
    return out


def _index(n: int) -> CacheIndex:
    lengths, parts = _layout(n)
    order = np.concatenate([m for _, m in parts])
    counts = [len(m) for _, m in parts]
    infos = [PartInfo(bucket=b, name=f"p{k:06d}", n_samples=len(m), n_tokens=int(lengths[m].sum()))
             for k, (b, m) in enumerate(parts)]
    return CacheIndex(sample_ids=order.astype(np.int64), lengths=lengths[order].astype(np.int32),
                      buckets=np.repeat(np.array([b for b, _ in parts], np.int16), counts),
                      part=np.repeat(np.arange(len(parts), dtype=np.int32), counts),
                      row=np.concatenate([np.arange(c, dtype=np.int32) for c in counts]),
                      token_start=np.zeros(n, np.int64), parts=infos)


def child_memory(n: int) -> dict:
    """Part selection, planner and 6 epoch plans on in-memory index arrays of ``n`` samples."""
    idx = _index(n)
    rss0 = _peak_rss_mb()
    keys = [p.key for p in idx.parts]
    t = time.perf_counter()
    table = select_parts(idx, keys)
    select_all = time.perf_counter() - t
    t = time.perf_counter()
    half = select_parts(idx, keys[::2])
    select_half = time.perf_counter() - t
    settings = PlanSettings.from_config(CFG, seed=0, num_anchors=ANCHORS, block_size=BLOCK)
    t = time.perf_counter()
    planner = Planner(table.sample_ids, table.lengths, table.buckets, settings)
    t_planner = time.perf_counter() - t
    t = time.perf_counter()
    plans = [planner.plan(e) for e in range(EPOCHS)]  # kept, as the loader keeps them
    t_plans = time.perf_counter() - t
    plan_bytes = sum(a.nbytes for p in plans for a in (p.positions, p.row_starts, p.batch_rows, p.bucket,
                                                       p.seq_len, p.n_tokens, p.block_positions, p.seed))
    out = {"select_all_parts_s": select_all, "select_half_parts_s": select_half, "half_samples": len(half),
           "planner_s": t_planner, "plans_6_epochs_s": t_plans, "plan_0_batches": len(plans[0]),
           "plans_6_epochs_mb": plan_bytes / 2**20, "index_mb": sum(a.nbytes for a in (
               idx.sample_ids, idx.lengths, idx.buckets, idx.part, idx.row, idx.token_start)) / 2**20,
           "peak_rss_mb": _peak_rss_mb(), "rss_with_index_mb": rss0}
    if n <= 300_000:  # the selection before this change: np.isin on per-sample part-key strings (quadratic)
        part_keys = np.array(keys, dtype=object)[idx.part]
        t = time.perf_counter()
        np.isin(part_keys, np.array(keys[::2], dtype=object))
        out["old_isin_select_half_s"] = time.perf_counter() - t
    return out


def preset_blocks(n: int = 100_000) -> dict:
    """Block positions per batch and steps per epoch of the qwen3-8b settings, with and without the budget."""
    lengths = _lengths(n)
    ids = np.arange(n, dtype=np.int64)
    buckets = np.searchsorted(EDGES, lengths, side="left")
    out = {"samples": n, "tokens_per_batch": CFG.tokens_per_batch, "num_anchors": ANCHORS, "block_size": BLOCK}
    for name, budget in (("budget_65536", 65536), ("no_budget", None)):
        s = PlanSettings(seed=0, num_anchors=ANCHORS, block_size=BLOCK, tokens_per_batch=CFG.tokens_per_batch,
                         max_block_positions=budget, holdout_fraction=CFG.holdout_fraction)
        st = Planner(ids, lengths, buckets, s).plan(0).stats
        out[name] = {"block_positions_median": st.block_positions_median, "block_positions_max":
                     st.block_positions_max, "steps_per_epoch": st.n_batches,
                     "tokens_per_step_mean": st.n_tokens / st.n_batches, "padding_fraction": st.padding_fraction}
    return out


def _spawn(*args: str) -> dict:
    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load_avg": load}


def _summary(runs: list[dict]) -> dict:
    out: dict = {"runs": runs}
    for k, v in runs[0].items():
        if isinstance(v, float):
            vals = [r[k] for r in runs]
            out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--disk", default="100000,1000000", help="sample counts of the on-disk caches")
    ap.add_argument("--memory", default="100000,1000000,3000000,10000000", help="sample counts in memory")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/bench_datapath")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the caches")
    ap.add_argument("--child-disk", nargs=2, metavar=("URL", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--child-memory", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_disk:
        print(json.dumps(child_disk(*args.child_disk)))
        return
    if args.child_memory:
        print(json.dumps(child_memory(args.child_memory)))
        return
    work = Path(args.workdir)
    disk_sizes = [int(x) for x in args.disk.split(",") if x]
    mem_sizes = [int(x) for x in args.memory.split(",") if x]
    res: dict = {"cpu_cores": os.cpu_count(), "load_avg_start": os.getloadavg()[0], "epochs": EPOCHS,
                 "samples_per_part": PER_PART, "loader": CFG.model_dump(), "builds": {}}
    urls = {}
    for n in disk_sizes:
        urls[n] = str(work / f"cache-{n}")
        if not (args.keep and (Path(urls[n]) / "zarr.json").exists()):
            shutil.rmtree(urls[n], ignore_errors=True)
            res["builds"][n] = build_cache(urls[n], n)
            print(f"built {n} samples: {res['builds'][n]}", flush=True)
    raw: dict = {}
    for run in range(args.runs):  # interleaved: every size and mode once per round
        for n in disk_sizes:
            for mode in ("loader", "train"):
                raw.setdefault(f"disk_{mode}_{n}", []).append(_spawn("--child-disk", urls[n], mode))
        for n in mem_sizes:
            raw.setdefault(f"memory_{n}", []).append(_spawn("--child-memory", str(n)))
        print(f"round {run + 1}/{args.runs} done", flush=True)
    res["results"] = {k: _summary(v) for k, v in raw.items()}
    res["preset_qwen3_8b"] = preset_blocks()
    res["extrapolated_10m"] = _extrapolate(res["results"], disk_sizes, mem_sizes)
    res["load_avg_end"] = os.getloadavg()[0]
    out = Path(__file__).parent / "results" / "bench_datapath.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    _print(res)
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def _extrapolate(results: dict, disk_sizes: list[int], mem_sizes: list[int]) -> dict | None:
    """10M-sample train start-up = the largest disk cache's start-up, its O(parts) disk part (listing + index)
    scaled linearly to 10M, its in-memory part replaced by the 10M in-memory measurement."""
    if not disk_sizes or 10_000_000 not in mem_sizes:
        return None
    n = max(disk_sizes)
    med = lambda key, field: results[key][field]["median"]  # noqa: E731
    disk_part = med(f"disk_loader_{n}", "parts_listing_s") + med(f"disk_loader_{n}", "index_s")
    mem_n = med(f"memory_{n}", "select_all_parts_s") + med(f"memory_{n}", "planner_s") + \
        med(f"memory_{n}", "plans_6_epochs_s") if n in mem_sizes else None
    mem_10m = med("memory_10000000", "select_all_parts_s") + med("memory_10000000", "planner_s") + \
        med("memory_10000000", "plans_6_epochs_s")
    train_n = med(f"disk_train_{n}", "first_batch_s")
    if mem_n is None:
        return None
    rest = max(train_n - disk_part - mem_n, 0.0)  # open, first read, threads: not growing with samples
    scale = 10_000_000 / n
    return {"from_samples": n, "disk_part_s": disk_part * scale, "memory_part_s": mem_10m, "rest_s": rest,
            "train_first_batch_s": disk_part * scale + mem_10m + rest}


def _print(res: dict) -> None:
    r = res["results"]
    print(f"{'measurement':32s} {'median s':>9s} {'min':>7s} {'max':>7s} {'peak RSS MB':>12s}")
    for k, v in r.items():
        f = v.get("first_batch_s") or v.get("plans_6_epochs_s")
        print(f"{k:32s} {f['median']:9.2f} {f['min']:7.2f} {f['max']:7.2f} {v['peak_rss_mb']['median']:12.0f}")
    p = res["preset_qwen3_8b"]
    for name in ("budget_65536", "no_budget"):
        q = p[name]
        print(f"qwen3-8b {name:13s}: block positions/step median {q['block_positions_median']:.0f} max "
              f"{q['block_positions_max']}, steps/epoch {q['steps_per_epoch']}")
    if res.get("extrapolated_10m"):
        print(f"10M train start-up to first batch (extrapolated): {res['extrapolated_10m']['train_first_batch_s']:.1f} s")


if __name__ == "__main__":
    main()

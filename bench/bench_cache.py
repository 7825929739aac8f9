"""Feature-cache benchmark: codec size and speed, fp8 error, random-sample reads vs one torch.save
file per sample, and index build time for 1M samples. Prints a table and writes
bench/results/bench_cache.json.

    .venv/bin/python bench/bench_cache.py [--quick] [--dir /tmp/dflash-bench]

Activations are synthetic but shaped like a trained LLM's (a few outlier channels at 100-1000x the
typical magnitude; see dflash_cache.synthetic). Everything runs on one thread (torch and blosc
single-threaded, shard encoding with DFLASH_CACHE_ENCODE_THREADS=1) unless noted; "encode Nt" is the
writer with its default encode threads. Reads: "rand fresh" returns new tensors per sample
(cache.read_sample), "rand into" decodes into one reused buffer (read_tokens_into: the loader's path).
The machine is shared: the load average is recorded, compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from dflash_cache import CacheSpec, TeacherInfo, codecs, create_cache
from dflash_cache.reader import PartReader
from dflash_cache.synthetic import synthetic_features

RESULTS = Path(__file__).resolve().parent / "results" / "bench_cache.json"
CODECS = ("bf16-zstd", "bf16-lz4", "bf16-raw", "fp8-e4m3")


def make_samples(n: int, n_layers: int, hidden: int, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    """``n`` samples of 200-3000 tokens: (sample id, bf16 features [T, n*H])."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(200, 3001))
        gen_i = torch.Generator().manual_seed(seed)  # same outlier channels in every sample ...
        feats = synthetic_features(t, n_layers, hidden, gen_i)
        feats = (feats.float() * (1 + 0.02 * torch.randn(feats.shape, generator=gen))).to(torch.bfloat16)  # ... fresh noise
        out.append((i, feats))
    return out


def spec_for(codec: str, n_layers: int, hidden: int, edges: tuple[int, ...] = ()) -> CacheSpec:
    return CacheSpec(TeacherInfo("bench", None, n_layers + 3, hidden, 1000, "bfloat16"),
                     list(range(1, n_layers + 1)), "bench", 3072, codec=codec, bucket_edges=list(edges),
                     dataset_fingerprint="bench")


def write_cache(url: Path, codec: str, samples, n_layers: int, hidden: int) -> tuple[object, float]:
    shutil.rmtree(url, ignore_errors=True)
    cache = create_cache(str(url), spec_for(codec, n_layers, hidden), chunk_tokens=256, shard_tokens=16384)
    t0 = time.perf_counter()
    with cache.part_writer(0, "p0") as w:
        for sid, feats in samples:
            t = feats.shape[0]
            w.add(sid, torch.zeros(t, dtype=torch.long), torch.ones(t, dtype=torch.bool), feats)
    return cache, time.perf_counter() - t0


def drop_page_cache(path: Path) -> bool:
    """Evict the files under ``path`` from the page cache (no root needed for clean pages)."""
    os.sync()
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def dir_stats(path: Path) -> tuple[int, int]:
    files = [Path(d) / f for d, _, fs in os.walk(path) for f in fs]
    return len(files), sum(f.stat().st_size for f in files)


def fp8_error(samples, cache) -> dict[str, float]:
    rel_max, rel_sum, rel_n, cos_min, zeros, total = 0.0, 0.0, 0, 1.0, 0, 0
    got = cache.read_samples([s for s, _ in samples])
    for (_, x), s in zip(samples, got, strict=True):
        xf, yf = x.float(), s.features.float()
        cos_min = min(cos_min, float(torch.nn.functional.cosine_similarity(xf, yf, dim=-1).min()))
        # "not tiny": above 1% of the token's per-layer absmax (smaller ones sit under fp8's range)
        n_l = cache.spec.n_layers
        amax = xf.reshape(xf.shape[0], n_l, -1).abs().amax(-1, keepdim=True).expand(-1, -1, xf.shape[1] // n_l)
        big = xf.abs() > 0.01 * amax.reshape(xf.shape)
        rel = ((yf - xf).abs() / xf.abs())[big]
        rel_max, rel_sum, rel_n = max(rel_max, float(rel.max())), rel_sum + float(rel.sum()), rel_n + rel.numel()
        zeros += int(((yf == 0) & (xf != 0)).sum())
        total += xf.numel()
    return {"max_rel_err": rel_max, "mean_rel_err": rel_sum / rel_n, "min_token_cosine": cos_min,
            "flushed_to_zero_fraction": zeros / total}


def read_all(cache, ids: list[int]) -> float:
    t0 = time.perf_counter()
    for sid in ids:
        cache.read_sample(sid)
    return time.perf_counter() - t0


def read_all_into(cache, ids: list[int]) -> float:
    """The same samples decoded into one reused buffer (what the loader does with its batch buffers)."""
    idx = cache.index()
    pos = idx.positions(ids)
    readers = {i: PartReader(cache.storage, p) for i, p in enumerate(idx.parts)}
    buf = torch.empty(int(idx.lengths.max()), cache.spec.feature_dim, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for p in pos.tolist():
        r = readers[int(idx.part[p])]
        a, b = r.span(int(idx.row[p]))
        r.read_tokens_into(a, b, buf[:b - a])
    return time.perf_counter() - t0


def timed_write(url: Path, codec: str, samples, n_layers: int, hidden: int, threads: int) -> tuple[object, float]:
    os.environ["DFLASH_CACHE_ENCODE_THREADS"] = str(threads)
    try:
        return write_cache(url, codec, samples, n_layers, hidden)
    finally:
        del os.environ["DFLASH_CACHE_ENCODE_THREADS"]


def best_of(fn, *args, reps: int = 3) -> float:
    """Fastest of ``reps`` calls of ``fn(*args)`` (which returns seconds): the least disturbed by other
    work on a shared machine."""
    return min(fn(*args) for _ in range(reps))


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def bench_codecs(root: Path, samples, n_layers: int, hidden: int) -> dict:
    raw_bytes = sum(f.numel() * 2 for _, f in samples)
    out = {}
    threads = codecs.encode_threads()
    for codec in CODECS:
        t_write_n = None
        if threads > 1 and codec == "bf16-zstd":
            t_write_n = timed_write(root / codec, codec, samples, n_layers, hidden, threads)[1]
        cache, t_write = timed_write(root / codec, codec, samples, n_layers, hidden, 1)
        part = cache.parts()[0]
        whole = torch.empty(part.n_tokens, cache.spec.feature_dim, dtype=torch.bfloat16)
        reader = PartReader(cache.storage, part)
        t_seq = best_of(timed, cache.read_tokens, part, 0, part.n_tokens)
        t_seq_into = best_of(timed, reader.read_tokens_into, 0, part.n_tokens, whole)
        ids = np.random.default_rng(1).permutation(len(samples)).tolist()
        read_all(cache, ids)  # warm
        t_warm = best_of(read_all, cache, ids)
        t_into = best_of(read_all_into, cache, ids)
        drop_page_cache(root / codec)
        cache = type(cache)(cache.storage, cache.spec, cache.chunk_tokens, cache.shard_tokens)  # fresh reader
        t_cold = read_all(cache, ids)
        drop_page_cache(root / codec)
        t_into_cold = read_all_into(cache, ids)
        out[codec] = {
            "bytes_vs_raw_bf16": part.feature_bytes / raw_bytes,
            "encode_gbps": raw_bytes / t_write / 1e9,
            "decode_sequential_gbps": raw_bytes / t_seq / 1e9,
            "decode_sequential_into_gbps": raw_bytes / t_seq_into / 1e9,
            "random_samples_warm_gbps": raw_bytes / t_warm / 1e9,
            "random_into_warm_gbps": raw_bytes / t_into / 1e9,
            "random_samples_cold_gbps": raw_bytes / t_cold / 1e9,
            "random_into_cold_gbps": raw_bytes / t_into_cold / 1e9,
            "files": dir_stats(root / codec / part.key)[0],
        }
        if t_write_n is not None:
            out[codec].update(encode_threads=threads, encode_gbps_threads=raw_bytes / t_write_n / 1e9)
        if codec == "bf16-zstd":
            ref = bench_blosc_decode(root / codec)
            out[codec].update(blosc_only_decode_gbps=ref["part_dest"], blosc_only_decode_cached_dest_gbps=ref["cached_dest"])
        if codec == "fp8-e4m3":
            out[codec]["error"] = fp8_error(samples, cache)
        shutil.rmtree(root / codec)
    return out


def bench_torch_save(root: Path, samples) -> dict:
    d = root / "per-sample-files"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    raw_bytes = sum(f.numel() * 2 for _, f in samples)
    for sid, feats in samples:
        t = feats.shape[0]
        torch.save({"input_ids": torch.zeros(t, dtype=torch.long), "loss_mask": torch.ones(t, dtype=torch.bool),
                    "hidden_states": feats}, d / f"{sid}.pt")
    ids = np.random.default_rng(1).permutation(len(samples)).tolist()

    def read() -> float:
        t0 = time.perf_counter()
        for sid in ids:
            torch.load(d / f"{sid}.pt", weights_only=True)
        return time.perf_counter() - t0

    read()
    t_warm = read()
    drop_page_cache(d)
    t_cold = read()
    n_files, n_bytes = dir_stats(d)
    shutil.rmtree(d)
    return {"files": n_files, "bytes_vs_raw_bf16": n_bytes / raw_bytes, "random_samples_warm_gbps": raw_bytes / t_warm / 1e9,
            "random_samples_cold_gbps": raw_bytes / t_cold / 1e9}


def bench_blosc_decode(cache_dir: Path) -> dict[str, float]:
    """Codec-level reference (GB/s decoded, best of 3): numcodecs blosc-decodes every inner chunk of the
    bf16-zstd features, held in memory, into one chunk-sized buffer that stays in the CPU cache
    ("cached dest"), and into consecutive slices of a part-sized buffer, as the reader writes ("part dest")."""
    import numcodecs.blosc

    from dflash_cache import open_cache

    cache = open_cache(str(cache_dir))
    part = cache.parts()[0]
    chunks = []
    for shard in range(-(-part.n_tokens // part.shard_tokens)):
        blob = (cache_dir / part.data_key / "features" / "c" / str(shard) / "0").read_bytes()
        n_inner = part.shard_tokens // part.chunk_tokens
        idx = np.frombuffer(blob[-16 * n_inner - 4:-4], "<u8").reshape(-1, 2)
        chunks += [np.frombuffer(blob, np.uint8, int(n) - 4, int(o)) for o, n in idx if o != 2**64 - 1]
    size = part.chunk_tokens * cache.spec.feature_dim * 2
    small, big = np.empty(size, np.uint8), np.empty(len(chunks) * size, np.uint8)

    def run(dest_of) -> None:
        for i, c in enumerate(chunks):
            numcodecs.blosc.decompress(c, dest_of(i))

    run(lambda i: big[i * size:(i + 1) * size])  # first touch of the part-sized buffer
    cached = best_of(timed, run, lambda i: small)
    spread = best_of(timed, run, lambda i: big[i * size:(i + 1) * size])
    return {"cached_dest": len(chunks) * size / cached / 1e9, "part_dest": len(chunks) * size / spread / 1e9}


def bench_index(root: Path, n_samples: int, per_part: int) -> dict:
    url = root / "index"
    shutil.rmtree(url, ignore_errors=True)
    cache = create_cache(str(url), spec_for("bf16-zstd", 1, 8, edges=(64, 128)), chunk_tokens=256, shard_tokens=16384)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for p in range(n_samples // per_part):
        lens = rng.integers(1, 17, size=per_part)
        total = int(lens.sum())
        with cache.part_writer(0, f"u{p:06d}") as w:
            w.add_batch(np.arange(p * per_part, (p + 1) * per_part), lens, np.zeros(total, np.int32),
                        np.ones(total, bool), torch.zeros(total, 8, dtype=torch.bfloat16))
    t_write = time.perf_counter() - t0
    from dflash_cache import open_cache

    cache = open_cache(str(url))
    t0 = time.perf_counter()
    idx = cache.index()
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.index()
    t_second = time.perf_counter() - t0
    assert len(idx) == n_samples
    shutil.rmtree(url)
    return {"n_samples": n_samples, "n_parts": n_samples // per_part, "index_seconds": t_first,
            "index_seconds_again": t_second, "write_seconds": t_write}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, figures not meaningful)")
    ap.add_argument("--dir", default="/tmp/dflash-bench")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("DFLASH_CACHE_FSYNC", "0")  # measure the codec, not the disk's flush latency
    torch.set_num_threads(1)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    n = 8 if args.quick else 48
    hidden = 128 if args.quick else args.hidden
    samples = make_samples(n, args.layers, hidden)
    n_tokens = sum(f.shape[0] for _, f in samples)
    res = {"setup": {"n_samples": n, "n_tokens": n_tokens, "feature_dim": args.layers * hidden,
                     "raw_bf16_bytes": n_tokens * args.layers * hidden * 2, "threads": 1,
                     "crc32c": codecs.CRC_IMPL,
                     "load_avg_start": os.getloadavg()[0], "cpu_count": os.cpu_count()}}
    res["codecs"] = bench_codecs(root, samples, args.layers, hidden)
    res["torch_save_per_sample"] = bench_torch_save(root, samples)
    res["index"] = bench_index(root, 20_000 if args.quick else 1_000_000, 2000)
    shutil.rmtree(root, ignore_errors=True)
    res["setup"]["load_avg_end"] = os.getloadavg()[0]
    report(res)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=1))
    print(f"wrote {RESULTS}")


def report(res: dict) -> None:
    s = res["setup"]
    print(f"{s['n_samples']} samples of 200-3000 tokens, {s['n_tokens']} tokens, width {s['feature_dim']}, "
          f"{s['raw_bf16_bytes'] / 1e9:.2f} GB raw bf16, 1 thread; crc32c: {s['crc32c']}; "
          f"load average {s['load_avg_start']:.1f} -> {s['load_avg_end']:.1f} "
          f"on {s['cpu_count']} cores")
    print("GB/s of raw bf16 (useful) bytes, best of 3 (cold: 1); seq = a whole part; rand = random whole samples;"
          " fresh = new tensors, into = a reused buffer")
    print(f"{'format':18s} {'size/raw':>8s} {'enc 1t':>7s} {'seq fresh':>9s} {'seq into':>9s} {'rand fresh':>10s} "
          f"{'rand into':>10s} {'cold fresh':>10s} {'cold into':>10s} {'files':>6s}")
    for name, r in res["codecs"].items():
        print(f"{name:18s} {r['bytes_vs_raw_bf16']:8.3f} {r['encode_gbps']:7.3f} {r['decode_sequential_gbps']:9.3f} "
              f"{r['decode_sequential_into_gbps']:9.3f} {r['random_samples_warm_gbps']:10.3f} "
              f"{r['random_into_warm_gbps']:10.3f} {r['random_samples_cold_gbps']:10.3f} "
              f"{r['random_into_cold_gbps']:10.3f} {r['files']:6d}")
    t = res["torch_save_per_sample"]
    print(f"{'torch.save/sample':18s} {t['bytes_vs_raw_bf16']:8.3f} {'-':>7s} {'-':>9s} {'-':>9s} "
          f"{t['random_samples_warm_gbps']:10.3f} {'-':>10s} {t['random_samples_cold_gbps']:10.3f} {'-':>10s} "
          f"{t['files']:6d}")
    z = res["codecs"]["bf16-zstd"]
    print(f"bf16-zstd: blosc-only decode {z['blosc_only_decode_gbps']:.3f} GB/s into a part-sized buffer "
          f"({z['blosc_only_decode_cached_dest_gbps']:.3f} into a cache-resident one); reader / codec: seq into "
          f"{z['decode_sequential_into_gbps'] / z['blosc_only_decode_gbps']:.2f}, rand into "
          f"{z['random_into_warm_gbps'] / z['blosc_only_decode_gbps']:.2f}; encode "
          f"{z.get('encode_threads', 1)} threads {z.get('encode_gbps_threads', z['encode_gbps']):.3f} GB/s")
    e = res["codecs"]["fp8-e4m3"]["error"]
    print(f"fp8-e4m3 error: max rel {e['max_rel_err']:.4f}, mean rel {e['mean_rel_err']:.4f}, min token cosine "
          f"{e['min_token_cosine']:.5f}, flushed to zero {e['flushed_to_zero_fraction']:.2e}")
    i = res["index"]
    print(f"index: {i['n_samples']} samples in {i['n_parts']} parts: {i['index_seconds']:.2f} s "
          f"(again {i['index_seconds_again']:.2f} s)")


if __name__ == "__main__":
    main()

"""Cost of binding shards and small arrays to their commit record, against the loader's own time.

What binding adds when a part is opened: the crc32c of each small array (input_ids, loss_mask,
offsets, sample_ids, target_argmax) when it is loaded, one crc32c of each shard's index (from the
record's chunk table) and one integer comparison per chunk read (its stored crc32c against the table). This measures both ways, on one synthetic cache with
the 27B teacher's width (5 x 5120 features per token):

- direct: the time of exactly the added work (crc32c of every part's small arrays) over the time of
  one loader epoch;
- A/B: loader epochs with binding on and off (the commit record's checksums hidden from the
  reader), interleaved rounds; at a < 1% effect this is within the noise of a shared machine.

    python bench/bench_binding.py [--tokens 60000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

import dflash_cache.reader as reader_mod
from dflash_cache import open_cache
from dflash_cache.codecs import crc32c
from dflash_cache.synthetic import make_synthetic_cache, synthetic_lengths
from train.config import LoaderConfig
from train.data.loader import StreamingLoader

_BOUND = reader_mod.layouts_for


def _unbound(part):
    return {k: dataclasses.replace(v, index_crcs=None, crc32c=None, chunk_tables=None, inline=None)
            for k, v in _BOUND(part).items()}


def _epoch(url: str, bound: bool) -> float:
    reader_mod.layouts_for = _BOUND if bound else _unbound
    cache = open_cache(url)  # fresh: no part opened yet
    cfg = LoaderConfig(tokens_per_batch=8192, num_readers=2, holdout_fraction=0.0)
    t0 = time.perf_counter()
    with StreamingLoader(cache, cfg, seed=0, num_anchors=64, block_size=16, max_epochs=1) as loader:
        for _ in loader:
            pass
    return time.perf_counter() - t0


def _direct(url: str) -> float:
    cache = open_cache(url)
    readers = [cache._readers.get(p) for p in cache.parts()]
    arrays = [r.readers[n].read(0, r.layouts[n].shape[0]) for r in readers for n in r.layouts
              if n not in ("features", "scales")]
    t0 = time.perf_counter()
    for a in arrays:
        crc32c(a)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=60_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/bench_binding")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    url = str(Path(args.workdir) / "cache")
    lengths = synthetic_lengths(max(8, args.tokens // 400), np.random.default_rng(0), 50, 3000, 400)
    make_synthetic_cache(url, len(lengths), lengths=lengths.tolist(), hidden_size=5120, num_layers=8,
                         target_layer_ids=(0, 1, 2, 3, 4), vocab_size=512, max_length=4096,
                         bucket_edges=(256, 512, 1024, 2048), samples_per_part=16, seed=0)
    _epoch(url, True)  # warm the page cache
    on, off, direct = [], [], []
    for _ in range(args.rounds):
        on.append(_epoch(url, True))
        off.append(_epoch(url, False))
        direct.append(_direct(url))
    med = statistics.median
    print(f"load average {os.getloadavg()[0]:.1f}; {sum(lengths)} tokens, {len(open_cache(url).parts())} parts")
    print(f"loader epoch, binding on : median {med(on):.3f} s (range {min(on):.3f}-{max(on):.3f})")
    print(f"loader epoch, binding off: median {med(off):.3f} s (range {min(off):.3f}-{max(off):.3f})")
    print(f"added work (small-array crc32c of every part): median {med(direct) * 1e3:.2f} ms = "
          f"{100 * med(direct) / med(on):.3f}% of an epoch (range {min(direct) * 1e3:.2f}-{max(direct) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()

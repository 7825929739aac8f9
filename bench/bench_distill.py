"""Distribution losses: what they cost next to CE, in the training step and in the cache.

* **step**: one whole fp32 CPU training step (``train.loop.step.train_step``: forward, chunked loss, backward,
  clipping, AdamW) of the same drafter on the same batch, with ``train.loss = ce`` and with a distribution
  loss (default ``lk_lambda``; the batch carries the teacher's final state as one more feature slot). The
  variants run interleaved (A B, B A, ...) with one intra-op thread so the load of a shared machine falls on
  both; time per step (CPU and wall), the peak of the tensors allocated during the step
  (``train.components.memory.peak_memory_bytes``) plus the static weights/optimizer/batch, and their ratios.
* **cache**: stored bytes per token of a synthetic cache (activations with outlier channels,
  ``dflash_cache.synthetic``) per codec, without and with ``final_hidden`` (one more H-wide slot per token).

    .venv/bin/python bench/bench_distill.py [--hidden 512 --vocab 16384 --rounds 3 --loss lk_lambda]

Prints the figures and writes bench/results/bench_distill.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_cache.runtime.dist import Distributed  # noqa: E402
from dflash_cache.spec import CODECS  # noqa: E402
from dflash_cache.synthetic import make_synthetic_cache  # noqa: E402
from train.components.guards import SpikeGuard  # noqa: E402
from train.components.memory import peak_memory_bytes  # noqa: E402
from train.config import GuardsConfig, TrainConfig  # noqa: E402
from train.data.batch import Batch  # noqa: E402
from train.loop.build import LossModule, build_optimizer, build_scheduler  # noqa: E402
from train.loop.step import train_step  # noqa: E402
from train.models.distill import DistributionLoss  # noqa: E402
from train.models.model import DFlashConfig, DFlashDrafter  # noqa: E402


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class StepRunner:
    """One drafter, optimizer and batch; ``step()`` runs one real training step."""

    def __init__(self, args: argparse.Namespace, loss: str):
        torch.manual_seed(0)
        H, V = args.hidden, args.vocab
        cfg = DFlashConfig(hidden_size=H, num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=H // 8, intermediate_size=3 * H, vocab_size=V, block_size=args.block_size,
                           mask_token_id=V - 1, target_layer_ids=[0, 1, 2], num_target_layers=6)
        head = (torch.randn(V, H) * 0.05).to(torch.bfloat16)
        self.model = DFlashDrafter(cfg, torch.randn(V, H).to(torch.bfloat16), head, attention="sdpa").train()
        tcfg = TrainConfig(num_anchors=args.anchors, logits_chunk_rows=args.chunk)
        self.opt = build_optimizer(tcfg, self.model)
        lm = LossModule(self.model, args.anchors, None, args.chunk)
        if loss != "ce":
            lm.distribution = DistributionLoss(loss, args.ce_weight)
        self.args = (lm, self.opt, build_scheduler(tcfg, self.opt, total_steps=1000),
                     SpikeGuard(GuardsConfig(window=16, min_history=1000)), tcfg, Distributed())
        g = torch.Generator().manual_seed(1)
        R, T, D = 2, args.doc_len * args.docs, (3 + (loss != "ce")) * H
        doc_ids = (torch.arange(T) // args.doc_len).to(torch.int32)
        pos = torch.arange(T) - doc_ids.long() * args.doc_len
        self.batch = Batch(features=torch.randn(R, T, D, generator=g).to(torch.bfloat16),
                           input_ids=torch.randint(0, V - 1, (R, T), generator=g),
                           loss_mask=(pos >= 8).expand(R, T).clone(), doc_ids=doc_ids.expand(R, T).clone(),
                           position_ids=pos.expand(R, T).clone(), sample_ids=torch.arange(R * args.docs), bucket=0,
                           epoch=0, index=0, n_tokens=R * T, n_padded=0, seed=3)
        self.n = 0
        self.step()  # the optimizer state exists from here on, as in every later step

    def step(self) -> Any:
        self.n += 1
        return train_step(self.n, [self.batch], *self.args)

    def static_bytes(self) -> int:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        ts = [*self.model.parameters(), *self.model.buffers(), *state, self.batch.features, self.batch.input_ids]
        return sum(t.numel() * t.element_size() for t in ts)


def bench_step(args: argparse.Namespace) -> dict:
    names = ["ce", args.loss]
    runners = {n: StepRunner(args, n) for n in names}
    out: dict[str, dict[str, list[float]]] = {n: {"cpu_s": [], "wall_s": [], "loadavg_1m": []} for n in names}
    peaks: dict[str, int] = {}
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            load = os.getloadavg()[0]
            c0, w0 = time.process_time(), time.perf_counter()
            res = runners[n].step()
            out[n]["cpu_s"].append(time.process_time() - c0)
            out[n]["wall_s"].append(time.perf_counter() - w0)
            out[n]["loadavg_1m"].append(load)
            assert res.loss == res.loss, f"{n}: NaN loss"
    for n in names:
        dynamic, _ = peak_memory_bytes(runners[n].step)
        peaks[n] = runners[n].static_bytes() + dynamic
    a, b = names
    return {
        "shape": {"hidden": args.hidden, "vocab": args.vocab, "layers": args.layers, "block_size": args.block_size,
                  "docs": args.docs, "doc_len": args.doc_len, "anchors": args.anchors, "chunk": args.chunk,
                  "loss": args.loss, "ce_weight": args.ce_weight},
        "cpu_s": {n: summary(out[n]["cpu_s"]) for n in names},
        "wall_s": {n: summary(out[n]["wall_s"]) for n in names},
        "cpu_time_ratio": statistics.median(out[b]["cpu_s"]) / statistics.median(out[a]["cpu_s"]),
        "peak_bytes": peaks, "peak_ratio": peaks[b] / peaks[a],
        "loadavg_1m": summary([v for n in names for v in out[n]["loadavg_1m"]]),
    }


def bench_cache(args: argparse.Namespace) -> dict:
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for codec in CODECS:
            row = {}
            for final in (False, True):
                url = str(Path(tmp) / f"{codec}-{final}")
                cache = make_synthetic_cache(url, n_samples=args.cache_samples, hidden_size=args.cache_hidden,
                                             num_layers=8, target_layer_ids=(1, 3, 5), vocab_size=512, codec=codec,
                                             median_length=256, max_length=1024, bucket_edges=(256, 512),
                                             chunk_tokens=256, shard_tokens=4096, final_hidden=final, with_head=False)
                parts = cache.parts()
                row["with_final" if final else "layers_only"] = (sum(p.feature_bytes for p in parts)
                                                                 / sum(p.n_tokens for p in parts))
            row["ratio"] = row["with_final"] / row["layers_only"]
            out[codec] = row
    return {"hidden": args.cache_hidden, "layers": 3, "bytes_per_token": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--doc-len", type=int, default=192)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--loss", default="lk_lambda", choices=["kl", "tv", "lk_lambda", "lk_alpha"])
    ap.add_argument("--ce-weight", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-hidden", type=int, default=1024)
    ap.add_argument("--cache-samples", type=int, default=24)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_distill.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg(),
               "step": bench_step(args), "cache": bench_cache(args), "loadavg_end": os.getloadavg()}
    s = results["step"]
    print(f"step ({args.loss} vs ce, hidden {args.hidden}, vocab {args.vocab}, chunk {args.chunk}): cpu time ratio "
          f"{s['cpu_time_ratio']:.2f} (ce median {s['cpu_s']['ce']['median']:.3f} s, {args.loss} "
          f"{s['cpu_s'][args.loss]['median']:.3f} s), peak memory ratio {s['peak_ratio']:.3f}; load "
          f"{s['loadavg_1m']['median']:.1f}")
    for codec, row in results["cache"]["bytes_per_token"].items():
        print(f"cache {codec:10s} {row['layers_only']:8.0f} B/token layers only, {row['with_final']:8.0f} with the "
              f"final state ({row['ratio']:.3f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

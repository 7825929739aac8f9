"""The presets at their real shapes over a realistic dataset: block positions per step and the step's peak
memory, before and after the block budget / chunked loss / per-document anchors.

    python bench/bench_presets.py [--samples 100000]

For each preset (qwen3-8b, qwen3.6-27b), over the plan of ``--samples`` samples of realistic length
(log-normal, median 800, 50..3072 tokens; the data path benchmark's distribution):

- **before**: the trainer as it was. The plan budgeted tokens only; each row (one sample) drew up to
  ``num_anchors`` anchors and every row computed ``N = max anchors over the batch's rows`` blocks (padding
  blocks included): ``R x N x B`` block positions. Its peak is the per-position cost measured with that code
  (issue "Real shapes"): the loss head at 12 bytes per block position per vocabulary entry (bf16 logits, an
  fp32 copy, an fp32 log-softmax) plus saved activations of 0.24 MB (8B) / 0.31 MB (27B) per block position
  per layer, plus the static state (weights, gradients, AdamW moments, the frozen head) as
  ``dflash-train estimate`` counts it.
- **after**: the current plan (``loader.max_block_positions``, anchors per document, real blocks only) and
  ``dflash-train estimate``'s memory model with the presets' settings (activation checkpointing, logits in
  chunks of ``train.logits_chunk_rows``).

Nothing here is timed: the figures are counts and arithmetic, identical on any machine. Writes
bench/results/bench_presets.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_cache.runtime.config import load_config  # noqa: E402
from dflash_cache.synthetic import synthetic_lengths  # noqa: E402
from train.data.plan import PlanSettings, build_plan  # noqa: E402
from train.tools.estimate import DrafterShape, Precision, StepShape, memory_estimate  # noqa: E402

GIB = 1024**3
EDGES = np.array([256, 512, 1024, 2048])
# measured with the code before the change (issue "Real shapes"): bytes per block position
OLD_HEAD_BYTES_PER_VOCAB = 12
OLD_ACT_PER_LAYER = {"qwen3-8b": 0.24e6, "qwen3.6-27b": 0.31e6}


def plan_of(cfg, lengths: np.ndarray, budget: int | None):
    ids = np.arange(len(lengths), dtype=np.int64)
    buckets = np.searchsorted(EDGES, lengths, side="left")
    lc = cfg.loader
    settings = PlanSettings(seed=0, tokens_per_batch=lc.tokens_per_batch, sort_window=lc.sort_window,
                            holdout_fraction=lc.holdout_fraction, num_anchors=cfg.train.num_anchors,
                            block_size=cfg.model.block_size, max_block_positions=budget)
    return build_plan(ids, lengths, buckets, settings, epoch=0)


def before(cfg, lengths: np.ndarray, shape: DrafterShape, preset: str) -> dict:
    """Block positions the old trainer computed per batch (rows x max anchors x B) and its peak."""
    plan = plan_of(cfg, lengths, None)
    na, B = cfg.train.num_anchors, cfg.model.block_size
    bp = []
    for k in range(len(plan)):
        b = plan.batch(k)
        n = np.minimum(na, lengths[b.positions] - 1)
        bp.append(b.num_rows * int(n.max()) * B)
    bp = np.array(bp)
    static = memory_estimate(shape, StepShape(0, 0, 0)).static
    per_pos = OLD_HEAD_BYTES_PER_VOCAB * shape.vocab + OLD_ACT_PER_LAYER[preset] * shape.layers
    peaks = static + bp * per_pos
    return {"block_positions_median": int(np.median(bp)), "block_positions_max": int(bp.max()),
            "peak_gib_median": round(float(np.median(peaks)) / GIB, 1), "peak_gib_max": round(float(peaks.max()) / GIB, 1),
            "steps_per_epoch": len(plan)}


def after(cfg, lengths: np.ndarray, shape: DrafterShape) -> dict:
    plan = plan_of(cfg, lengths, cfg.loader.max_block_positions)
    B = cfg.model.block_size
    rows = np.diff(plan.batch_rows)
    ctx = rows * plan.seq_len
    bp = plan.block_positions

    def peak(k: int) -> int:
        step = StepShape.worst(int(ctx[k]), int(bp[k]), B, float(lengths.mean()))
        return memory_estimate(shape, step, precision=Precision(), attention="flex",
                               checkpointing=cfg.model.activation_checkpointing,
                               chunk_rows=cfg.train.logits_chunk_rows).device_peak

    med = int(np.argsort(bp)[len(bp) // 2])
    worst = int(np.argmax(bp))
    return {"block_positions_median": int(np.median(bp)), "block_positions_max": int(bp.max()),
            "peak_gib_median": round(peak(med) / GIB, 1), "peak_gib_max": round(peak(worst) / GIB, 1),
            "steps_per_epoch": len(plan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    args = ap.parse_args()
    lengths = synthetic_lengths(args.samples, np.random.default_rng(0), 50, 3072, 800)
    out = {"samples": args.samples, "length_median": int(np.median(lengths)), "presets": {}}
    for preset in ("qwen3-8b", "qwen3.6-27b"):
        cfg = load_config(ROOT / "configs" / f"{preset}.toml")
        t = cfg.teacher
        shape = DrafterShape.from_config(cfg.model, t.hidden_size, t.vocab_size, len(cfg.cache.target_layer_ids))
        out["presets"][preset] = {"before": before(cfg, lengths, shape, preset), "after": after(cfg, lengths, shape)}
        for when in ("before", "after"):
            r = out["presets"][preset][when]
            print(f"{preset:12s} {when:6s} block positions per step median {r['block_positions_median']:>7d} "
                  f"max {r['block_positions_max']:>7d}; peak {r['peak_gib_median']:>6.1f} GiB median step, "
                  f"{r['peak_gib_max']:>6.1f} GiB largest; {r['steps_per_epoch']} steps per epoch")
    path = ROOT / "bench" / "results" / "bench_presets.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Extraction overhead: wall time of ``dflash-extract``'s loop divided by the bare teacher forward over
the same batches, in the same run, on a CPU-sized teacher where compute dominates. Goal <= 1.10
(writing fully overlapped), padding <= 3% of computed tokens.

Usage: python bench/bench_extract.py [--hidden 1024 --layers 4 --samples 96]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache.runtime.config import load_config  # noqa: E402
from extract.batching import collate, plan_batches  # noqa: E402
from extract.loop import run_extraction  # noqa: E402
from extract.teacher import capture_features, load_teacher  # noqa: E402
from extract.tiny import build_tiny_teacher  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build_teacher(path: Path, hidden: int, layers: int) -> Path:
    """The tiny teacher's tokenizer with a wider, deeper Qwen3 body (random weights)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    build_tiny_teacher(path)
    cfg = Qwen3Config.from_pretrained(path)
    cfg.update(dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 3,
                    num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64))
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def write_data(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = ["rivers", "bees", "clocks", "bridges", "tides", "gardens", "comets", "forests", "trains", "music", "storms", "maps"]
    with path.open("w") as f:
        for _ in range(n):
            reply = " ".join(rng.choice(words) for _ in range(rng.randint(60, 300)))
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me about " + rng.choice(words)},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def bare_forward_s(cfg, layer_ids: list[int]) -> tuple[float, int, int]:
    """Time the capture forward alone over the batches the extraction plans (same planner)."""
    from extract.data import load_records
    from extract.run_config import sample_rules

    model, tok = load_teacher(cfg.teacher)
    data = load_records(cfg.data.path)
    total, real, computed = 0.0, 0, 0
    u = cfg.extract.unit_size
    for start in range(0, data.n_total, u):
        recs = [r for r in data.records if start <= r.sample_id < start + u]
        samples, _ = sample_rules(cfg).prepare(recs, tok)
        for group in plan_batches(samples, cfg.extract.tokens_per_batch, cfg.extract.max_batch_size,
                                  cfg.extract.batch_overhead):
            b = collate(group, tok.pad_token_id)
            t0 = time.perf_counter()
            capture_features(model, b.input_ids, b.attention_mask, layer_ids)
            total += time.perf_counter() - t0
            real, computed = real + b.n_real, computed + b.n_computed
    return total, real, computed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        teacher = build_teacher(tmp / "teacher", args.hidden, args.layers)
        data = write_data(tmp / "data.jsonl", args.samples)
        overrides = [f"teacher.path={teacher}", f"data.path={data}", "cache.num_target_layers=3",
                     f"extract.tokens_per_batch={args.tokens_per_batch}", f"extract.unit_size={args.samples}",
                     "cache.bucket_edges=[256, 512]", "data.max_length=1024"]
        cfg = load_config(ROOT / "configs/tiny.toml", overrides)
        from extract.teacher import default_layer_ids

        layer_ids = default_layer_ids(args.layers, 3)
        # bare forward before and after the extraction (shared machines drift): their mean is the reference
        bare_before = bare_forward_s(cfg, layer_ids)[0]
        t0 = time.perf_counter()
        report = run_extraction(cfg, str(tmp / "cache"), progress=False)
        extract_s = time.perf_counter() - t0
        bare_after = bare_forward_s(cfg, layer_ids)[0]
    bare_s = (bare_before + bare_after) / 2
    loop_s = report.loop_s
    res = {
        "teacher": f"qwen3 hidden {args.hidden}, {args.layers} layers, features of layers {layer_ids}",
        "samples": report.samples_written, "tokens": report.tokens_written,
        "extract_wall_s": round(extract_s, 2), "extract_loop_s": round(loop_s, 2),
        "extract_forward_s": round(report.forward_s, 2), "bare_forward_s": round(bare_s, 2),
        "bare_forward_before_after_s": [round(bare_before, 2), round(bare_after, 2)],
        "ratio_extract_over_bare": round(loop_s / bare_s, 3),
        "ratio_whole_command_over_bare": round(extract_s / bare_s, 3),
        "writer_stall_s": round(report.stall_s, 3),
        "padding_fraction": round(report.padding_fraction, 4), "bytes_written": report.bytes_written,
        "tokens_per_s": round(report.tokens_written / extract_s, 1),
        "goal": {"ratio": 1.10, "padding_fraction": 0.03},
    }
    for k, v in res.items():
        print(f"{k}: {v}")
    out = ROOT / "bench/results/bench_extract.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Drafter step cost: forward+backward time per token and the share spent building the mask.

CPU (always): the tiny config (configs/tiny.toml model section on the tiny teacher's dimensions),
SDPA path. GPU (when CUDA is present): the Qwen3.6-27B-shaped drafter (hidden 5120, 5 layers,
4 sliding + 1 full, vocab 248320) with FlexAttention, reporting tokens/s and peak memory.

    .venv/bin/python bench/bench_drafter.py [--steps N] [--gpu-only | --cpu-only]

Prints the figures and writes bench/results/bench_drafter.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_cache.runtime.config import load_config  # noqa: E402
from train.attention import BlockLayout  # noqa: E402
from train.model import DFlashConfig, DFlashDrafter  # noqa: E402
from train.objective import build_blocks, dflash_loss, eligible_anchors, sample_anchors  # noqa: E402


def make_batch(rows: int, length: int, n_feat: int, vocab: int, device: torch.device, docs: int = 2):
    g = torch.Generator().manual_seed(0)
    doc_len = length // docs
    doc_ids = (torch.arange(length) // doc_len).clamp(max=docs - 1).to(torch.int32)
    pos = torch.arange(length) - doc_ids.long() * doc_len
    return SimpleNamespace(
        features=torch.randn(rows, length, n_feat, generator=g).to(torch.bfloat16).to(device),
        input_ids=torch.randint(0, vocab - 1, (rows, length), generator=g).to(device),
        loss_mask=(pos >= doc_len // 4).expand(rows, length).clone().to(device),
        doc_ids=doc_ids.expand(rows, length).clone().to(device),
        position_ids=pos.expand(rows, length).clone().to(device),
        seed=0,
    )


def mask_cost(model: DFlashDrafter, batch, num_anchors: int, backend: str) -> float:
    """Seconds to sample anchors, build the blocks and every distinct layer mask of one step."""
    sync = torch.cuda.synchronize if batch.input_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(1)
    anchors, valid = sample_anchors(eligible_anchors(batch.loss_mask, batch.doc_ids), num_anchors, g)
    blocks = build_blocks(batch, anchors, valid, model.block_size, model.mask_token_id)
    layout: BlockLayout = blocks.layout
    for layer in model.layers:
        a = layer.self_attn
        (layout.flex if backend == "flex" else layout.dense)(a.causal, a.window)
    sync()
    return time.perf_counter() - t0


def step_cost(model: DFlashDrafter, batch, num_anchors: int, steps: int, autocast: bool) -> tuple[float, int]:
    """Mean seconds of a forward+backward step, and the number of block rows (tokens) per step."""
    dev = batch.input_ids.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, rows = [], 0
    for i in range(steps + 1):
        batch.seed = i
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            out = dflash_loss(model, batch, num_anchors=num_anchors)
        out.loss.backward()
        sync()
        if i:  # the first step warms up (allocator, compile)
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        rows = int(out.metrics["n_blocks"]) * model.block_size
    return sum(times) / len(times), rows


def bench_cpu(steps: int) -> dict:
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    m = cfg.model
    hidden, vocab, n_feat = 128, 768, 3  # the tiny teacher's dimensions, 3 captured layers
    dcfg = DFlashConfig(hidden_size=hidden, num_hidden_layers=m.num_hidden_layers,
                        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                        head_dim=m.head_dim, intermediate_size=m.intermediate_size, vocab_size=vocab,
                        block_size=m.block_size, mask_token_id=5, target_layer_ids=[1, 2, 3], num_target_layers=6)
    torch.manual_seed(0)
    head = torch.randn(vocab, hidden)
    model = DFlashDrafter(dcfg, head, head, attention="sdpa").train()
    rows = max(1, cfg.loader.tokens_per_batch // 512)
    batch = make_batch(rows, 512, n_feat * hidden, vocab, torch.device("cpu"))
    step_s, tokens = step_cost(model, batch, cfg.train.num_anchors, steps, autocast=False)
    mask_s = min(mask_cost(model, batch, cfg.train.num_anchors, "sdpa") for _ in range(5))
    return {"device": "cpu", "threads": torch.get_num_threads(), "config": "tiny", "path": "sdpa",
            "rows": rows, "seq_len": 512, "num_anchors": cfg.train.num_anchors, "block_rows_per_step": tokens,
            "context_tokens_per_step": rows * 512, "step_ms": step_s * 1e3,
            "us_per_block_token": step_s / tokens * 1e6, "us_per_context_token": step_s / (rows * 512) * 1e6,
            "mask_ms": mask_s * 1e3, "mask_fraction": mask_s / step_s, "mask_goal": "< 0.05"}


def bench_gpu(steps: int) -> dict:
    dev = torch.device("cuda")
    cfg = load_config(ROOT / "configs" / "qwen3.6-27b.toml")
    m = cfg.model
    hidden, vocab = 5120, 248320
    dcfg = DFlashConfig(hidden_size=hidden, num_hidden_layers=m.num_hidden_layers,
                        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                        head_dim=m.head_dim, intermediate_size=m.intermediate_size, vocab_size=vocab,
                        block_size=m.block_size, mask_token_id=m.mask_token_id,
                        target_layer_ids=list(cfg.cache.target_layer_ids), num_target_layers=64,
                        rope_theta=m.rope_theta, layer_types=list(m.layer_types), sliding_window=m.sliding_window)
    torch.manual_seed(0)
    head = (torch.randn(vocab, hidden, device=dev) * 0.02).to(torch.bfloat16)
    model = DFlashDrafter(dcfg, head, head, attention="flex").to(dev).train()
    T = 3072
    batch = make_batch(1, T, 5 * hidden, vocab, dev)
    torch.cuda.reset_peak_memory_stats()
    step_s, tokens = step_cost(model, batch, cfg.train.num_anchors, steps, autocast=True)
    mask_s = min(mask_cost(model, batch, cfg.train.num_anchors, "flex") for _ in range(3))
    return {"device": torch.cuda.get_device_name(), "config": "qwen3.6-27b-shaped", "path": "flex",
            "rows": 1, "seq_len": T, "num_anchors": cfg.train.num_anchors, "block_rows_per_step": tokens,
            "step_ms": step_s * 1e3, "block_tokens_per_s": tokens / step_s, "context_tokens_per_s": T / step_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "mask_ms": mask_s * 1e3, "mask_fraction": mask_s / step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--gpu-only", action="store_true")
    args = ap.parse_args()
    results: dict = {"torch": torch.__version__, "python": platform.python_version()}
    if not args.gpu_only:
        results["cpu_tiny_sdpa"] = bench_cpu(args.steps)
    if torch.cuda.is_available() and not args.cpu_only:
        results["gpu_27b_flex"] = bench_gpu(args.steps)
    for name, r in results.items():
        if isinstance(r, dict):
            print(f"[{name}]")
            for k, v in r.items():
                print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
    out = ROOT / "bench" / "results" / "bench_drafter.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

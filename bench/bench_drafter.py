"""Drafter step cost: forward+backward time per block token and the share spent building the mask.

CPU (always): the tiny config (configs/tiny.toml model section on the tiny teacher's dimensions), SDPA path,
fp32, one intra-op thread by default. GPU (when CUDA is present): the Qwen3.6-27B-shaped drafter (hidden 5120,
5 layers, 4 sliding + 1 full, vocab 248320) with FlexAttention under bf16 autocast and the preset's
activation checkpointing and logits chunk, reporting tokens/s and the step's peak memory.

The mask share is the time to flatten the batch, sample anchors, build the blocks and every distinct layer
mask of one step (``BlockLayout.row_masks`` for SDPA, ``BlockLayout.flex`` for FlexAttention), over the step
time. Steps and mask builds alternate round by round, so that the load of a shared machine falls on both;
each figure is a median with its range and the load average.

``--gpu-path-on-cpu`` runs the GPU section's code (the 27B preset's layer types, sliding window, GQA ratio,
checkpointing, autocast) on the CPU with SDPA at a reduced shape: a check that it still runs and gives the
right shapes where no GPU is at hand, not a figure.

    .venv/bin/python bench/bench_drafter.py [--steps 5] [--threads 1] [--cpu-only | --gpu-only | --gpu-path-on-cpu]

Prints the figures and writes bench/results/bench_drafter.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_cache.runtime.config import load_config  # noqa: E402
from train.components.memory import peak_memory_bytes  # noqa: E402
from train.models.model import DFlashConfig, DFlashDrafter  # noqa: E402
from train.models.objective import FlatBatch, build_blocks, dflash_loss, sample_anchors  # noqa: E402


def make_batch(rows: int, length: int, n_feat: int, vocab: int, device: torch.device, docs: int = 2,
               feature_dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """``rows`` rows of ``docs`` packed documents; the loss mask is on the last 3/4 of each document."""
    g = torch.Generator().manual_seed(0)
    doc_len = length // docs
    doc_ids = (torch.arange(length) // doc_len).clamp(max=docs - 1).to(torch.int32)
    pos = torch.arange(length) - doc_ids.long() * doc_len
    return SimpleNamespace(
        features=torch.randn(rows, length, n_feat, generator=g).to(feature_dtype).to(device),
        input_ids=torch.randint(0, vocab - 1, (rows, length), generator=g).to(device),
        loss_mask=(pos >= doc_len // 4).expand(rows, length).clone().to(device),
        doc_ids=doc_ids.expand(rows, length).clone().to(device),
        position_ids=pos.expand(rows, length).clone().to(device),
        seed=0,
    )


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def build_masks(model: DFlashDrafter, batch: Any, num_anchors: int, backend: str, dtype: torch.dtype) -> int:
    """What a step does before the drafter's first layer: flatten the batch, sample anchors, build the blocks
    and every distinct layer mask (each layer asks its layout, which caches per layer kind). Returns the
    number of blocks."""
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, torch.Generator().manual_seed(1))
    blocks = build_blocks(flat, anchors, model.block_size, model.mask_token_id).to(batch.features.device)
    layout = blocks.layout
    for layer in model.layers:
        a = layer.self_attn
        if backend == "flex":
            layout.flex(a.within_block, a.window)
        else:
            layout.row_masks(a.within_block, a.window, dtype)
    return layout.num_blocks


def training_step(model: DFlashDrafter, batch: Any, num_anchors: int, chunk_rows: int,
                  autocast: bool) -> dict[str, torch.Tensor]:
    """One forward + backward of ``dflash_loss`` (the trainer's loss); returns its metrics."""
    dev = batch.features.device
    model.zero_grad(set_to_none=True)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        out = dflash_loss(model, batch, num_anchors=num_anchors, chunk_rows=chunk_rows)
    out.loss.backward()
    return out.metrics


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def measure(model: DFlashDrafter, batch: Any, *, num_anchors: int, chunk_rows: int, autocast: bool, backend: str,
            steps: int) -> dict[str, Any]:
    """Step and mask-building times, alternating (one warm-up step and mask build first), with the load average."""
    dev = batch.features.device
    sync = _sync(dev)
    mask_dtype = torch.bfloat16 if autocast else next(model.parameters()).dtype
    metrics = training_step(model, batch, num_anchors, chunk_rows, autocast)  # warm-up (allocator, compile)
    build_masks(model, batch, num_anchors, backend, mask_dtype)
    step_wall, step_cpu, mask_wall, mask_cpu, loads = [], [], [], [], []
    for _ in range(steps):
        loads.append(os.getloadavg()[0])
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        training_step(model, batch, num_anchors, chunk_rows, autocast)
        sync()
        step_wall.append(time.perf_counter() - t0)
        step_cpu.append(time.thread_time() - c0)
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        build_masks(model, batch, num_anchors, backend, mask_dtype)
        sync()
        mask_wall.append(time.perf_counter() - t0)
        mask_cpu.append(time.thread_time() - c0)
    n_blocks = int(metrics["n_blocks"])
    block_rows = n_blocks * model.block_size
    context = batch.input_ids.numel()
    peak, _ = peak_memory_bytes(lambda: training_step(model, batch, num_anchors, chunk_rows, autocast), dev)
    return {
        "blocks": n_blocks, "block_rows_per_step": block_rows, "context_tokens_per_step": context,
        "step_ms": summary([t * 1e3 for t in step_wall]),
        "step_cpu_ms": summary([t * 1e3 for t in step_cpu]),
        "us_per_block_token": summary([t / block_rows * 1e6 for t in step_wall]),
        "us_per_context_token": summary([t / context * 1e6 for t in step_wall]),
        "block_tokens_per_s": summary([block_rows / t for t in step_wall]),
        "mask_ms": summary([t * 1e3 for t in mask_wall]),
        "mask_fraction": summary([m / s for m, s in zip(mask_wall, step_wall, strict=True)]),
        # the same from this thread's CPU time (steadier on a loaded machine; on a GPU the wall figure counts)
        "mask_fraction_cpu": summary([m / s for m, s in zip(mask_cpu, step_cpu, strict=True)]),
        "step_peak_bytes_above_start": peak,
        "loadavg_1m": summary(loads),
        "loss": float(metrics["loss"]),
    }


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
    res = measure(model, batch, num_anchors=cfg.train.num_anchors, chunk_rows=cfg.train.logits_chunk_rows,
                  autocast=False, backend="sdpa", steps=steps)
    return {"device": "cpu", "threads": torch.get_num_threads(), "config": "tiny", "path": "sdpa", "dtype": "float32",
            "rows": rows, "seq_len": 512, "docs_per_row": 2, "num_anchors_per_doc": cfg.train.num_anchors,
            "hidden": hidden, "vocab": vocab, "layers": m.num_hidden_layers, "block_size": m.block_size,
            **res, "mask_goal": "< 0.05"}


def bench_27b(steps: int, device: torch.device, backend: str, reduced: bool) -> dict:
    """The Qwen3.6-27B preset's drafter and step settings; ``reduced`` shrinks every width (not the layer
    types, GQA ratio, block size or checkpointing) so that the same code runs on a CPU."""
    cfg = load_config(ROOT / "configs" / "qwen3.6-27b.toml")
    m, t = cfg.model, cfg.teacher
    if reduced:  # 1/40 of the widths; the sliding window and sequence shrink so that the window still bites
        hidden, vocab, heads, kv_heads, head_dim, inter = 128, 4096, 4, 1, 32, 384
        window, seq_len, anchors, mask_id = 96, 256, 32, 4000
    else:
        hidden, vocab, heads, kv_heads, head_dim, inter = (t.hidden_size, t.vocab_size, m.num_attention_heads,
                                                           m.num_key_value_heads, m.head_dim, m.intermediate_size)
        window, seq_len, anchors, mask_id = m.sliding_window, 3072, cfg.train.num_anchors, m.mask_token_id
    dcfg = DFlashConfig(hidden_size=hidden, num_hidden_layers=m.num_hidden_layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                        block_size=m.block_size, mask_token_id=mask_id,
                        target_layer_ids=list(cfg.cache.target_layer_ids), num_target_layers=t.num_layers,
                        rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta,
                        max_position_embeddings=m.max_position_embeddings, layer_types=list(m.layer_types),
                        sliding_window=window, sliding_within_block=m.sliding_within_block)
    torch.manual_seed(0)
    with torch.device(device):  # built in place: a 1.7B-parameter drafter never passes through host memory
        head = (torch.randn(vocab, hidden) * 0.02).to(torch.bfloat16)
        model = DFlashDrafter(dcfg, head, head, attention=backend,
                              activation_checkpointing=m.activation_checkpointing).train()
    n_feat = len(dcfg.target_layer_ids) * hidden
    batch = make_batch(1, seq_len, n_feat, vocab, device)
    res = measure(model, batch, num_anchors=anchors, chunk_rows=cfg.train.logits_chunk_rows, autocast=True,
                  backend=backend, steps=steps)
    if res["blocks"] != 2 * anchors:  # each document has more eligible positions than anchors
        raise RuntimeError(f"expected {2 * anchors} blocks (2 documents x {anchors} anchors), got {res['blocks']}")
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (code-path check)",
           "config": "qwen3.6-27b-shaped" + (" (reduced widths)" if reduced else ""), "path": backend,
           "precision": "bf16 autocast, fp32 weights", "activation_checkpointing": m.activation_checkpointing,
           "chunk_rows": cfg.train.logits_chunk_rows, "hidden": hidden, "vocab": vocab, "heads": heads,
           "kv_heads": kv_heads, "head_dim": head_dim, "intermediate": inter, "layer_types": list(m.layer_types),
           "sliding_window": window, "rows": 1, "seq_len": seq_len, "docs_per_row": 2,
           "num_anchors_per_doc": anchors, **res}
    if device.type == "cuda":
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def report(results: dict) -> None:
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        print(f"[{name}]")
        for k, v in r.items():
            if isinstance(v, dict) and "median" in v:
                print(f"  {k}: {v['median']:.4g} ({v['min']:.4g}-{v['max']:.4g}, n={v['n']})")
            else:
                print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (step + mask build), after one warm-up")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads on the CPU")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--cpu-only", action="store_true")
    group.add_argument("--gpu-only", action="store_true")
    group.add_argument("--gpu-path-on-cpu", action="store_true",
                       help="only the GPU section's code, on the CPU with SDPA at reduced widths (a check)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_drafter.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
                     "loadavg_start": os.getloadavg()}
    if args.gpu_path_on_cpu:
        results["cpu_27b_path_check"] = bench_27b(args.steps, torch.device("cpu"), "sdpa", reduced=True)
    else:
        if not args.gpu_only:
            results["cpu_tiny_sdpa"] = bench_cpu(args.steps)
        if torch.cuda.is_available() and not args.cpu_only:
            results["gpu_27b_flex"] = bench_27b(args.steps, torch.device("cuda"), "flex", reduced=False)
    results["loadavg_end"] = os.getloadavg()
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""How much the within-block rule of sliding-window layers changes a drafter's logits at the Qwen3.6-27B
preset's real shapes: ``model.sliding_within_block = "bidirectional"`` (the default, the DFlash reference's
rule) against ``"causal"`` (the rule of some sliding-window drafters), same weights, same batch.

    .venv/bin/python bench/bench_sliding_rule.py [--context 3072] [--anchors 8] [--vocab 16384]

The drafter has the preset's hidden size, heads, head dim, MLP width, layer types (4 sliding + 1 full) and
window; weights are the drafter's random initialisation, the embedding and lm_head are random (std 0.02)
with a vocabulary cut to ``--vocab`` rows (the rule acts on the hidden states; the lm_head only projects
them; the full 248k-row head would add 10 GB of fp32 for nothing). fp32 on CPU, ~7 GB of weights.
Prints the max and mean absolute difference of the block logits and the share of block positions whose
greedy token differs; writes bench/results/bench_sliding_rule.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dflash_cache.runtime.config import load_config
from train.models.model import DFlashConfig, DFlashDrafter
from train.models.objective import FlatBatch, build_blocks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bench_sliding_rule.json"
PRESET = ROOT / "configs" / "qwen3.6-27b.toml"


def preset_drafter_config(vocab: int) -> DFlashConfig:
    cfg = load_config(PRESET)
    m, t = cfg.model, cfg.teacher
    return DFlashConfig(
        hidden_size=t.hidden_size, num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, intermediate_size=m.intermediate_size,
        vocab_size=vocab, block_size=m.block_size, mask_token_id=vocab - 1,
        target_layer_ids=list(cfg.cache.target_layer_ids), num_target_layers=t.num_layers,
        rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, max_position_embeddings=m.max_position_embeddings,
        layer_types=list(m.layer_types), sliding_window=m.sliding_window, sliding_within_block="bidirectional",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=3072, help="context tokens (one document)")
    ap.add_argument("--anchors", type=int, default=8, help="blocks, at evenly spaced anchors")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    cfg = preset_drafter_config(args.vocab)
    H, T = cfg.hidden_size, args.context
    g = torch.Generator().manual_seed(args.seed)
    embed = torch.randn(cfg.vocab_size, H, generator=g) * 0.02
    lm_head = torch.randn(cfg.vocab_size, H, generator=g) * 0.02
    t0 = time.perf_counter()
    model = DFlashDrafter(cfg, embed, lm_head, attention="sdpa").eval()
    build_s = time.perf_counter() - t0
    n_feat = len(cfg.target_layer_ids) * H
    batch = SimpleNamespace(  # one document of T tokens
        features=torch.randn(1, T, n_feat, generator=g).to(torch.bfloat16),
        input_ids=torch.randint(0, cfg.vocab_size - 1, (1, T), generator=g),
        loss_mask=torch.ones(1, T, dtype=torch.bool),
        doc_ids=torch.zeros(1, T, dtype=torch.int32),
        position_ids=torch.arange(T).unsqueeze(0),
        seed=args.seed,
    )
    flat = FlatBatch.of(batch)
    anchors = torch.linspace(cfg.block_size, T - cfg.block_size - 1, args.anchors).long()  # [A]
    blocks = build_blocks(flat, anchors, cfg.block_size, cfg.mask_token_id)
    logits = {}
    for rule in ("bidirectional", "causal"):
        for i, layer in enumerate(model.layers):
            layer.self_attn.within_block = cfg.within_block(i) if rule == "bidirectional" else (
                "causal" if cfg.layer_type(i) == "sliding_attention" else "bidirectional")
        t0 = time.perf_counter()
        with torch.no_grad():
            hidden = model(batch.features, blocks.block_ids, blocks.block_positions, blocks.layout)  # [A, B, H]
            logits[rule] = model.logits(hidden).float()  # [A, B, V]
        print(f"{rule}: forward {time.perf_counter() - t0:.1f} s")
    diff = (logits["bidirectional"] - logits["causal"]).abs()
    agree = (logits["bidirectional"].argmax(-1) == logits["causal"].argmax(-1)).float()
    res = {
        "shapes": {"hidden": H, "layers": cfg.num_hidden_layers, "layer_types": cfg.layer_types,
                   "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                   "intermediate": cfg.intermediate_size, "window": cfg.sliding_window, "block": cfg.block_size,
                   "vocab_rows": cfg.vocab_size, "context": T, "anchors": args.anchors},
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "logit_std": float(logits["bidirectional"].std()),
        "greedy_token_differs_share": float(1 - agree.mean()),
        "max_abs_diff_per_position": [float(x) for x in diff.amax(dim=(0, 2))],
        "build_s": build_s,
        "load_avg": os.getloadavg()[0],
    }
    print(json.dumps({k: v for k, v in res.items() if k != "max_abs_diff_per_position"}, indent=1))
    print("max |diff| per block position:", " ".join(f"{x:.3g}" for x in res["max_abs_diff_per_position"]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

"""DFlash2 vs DFlash on the CPU at one tiny shape: training step time and one block's drafting time, and the
``dflash-train estimate`` peak of the DFlash2 27B preset against the DFlash one.

Both drafters have the tiny preset's shape by default (hidden 128, 2 layers, block 8, vocabulary 768; DFlash2
with its defaults: convolution 2/16, selector top 256 / rank 16); ``--hidden`` / ``--vocab`` change it. Rounds interleave the two families so load from other
processes hits both alike; each round times ``--steps`` training steps (``train_step``: forward, loss, backward,
AdamW) and ``--drafts`` block drafts (``train.tools.evaluate.propose``: one drafter forward over a 256-token context, then
the argmax or the selector's walk). Reports the median and range over rounds, and the DFlash2 / DFlash ratios.
Writes ``bench/results/bench_dflash2.json``.

    .venv/bin/python bench/bench_dflash2.py [--rounds 5] [--steps 5] [--drafts 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.dist import Distributed
from train.components.guards import SpikeGuard
from train.config import GuardsConfig, TrainConfig
from train.data.batch import Batch
from train.loop.build import LossModule, build_optimizer, build_scheduler, build_selector_loss
from train.loop.step import train_step
from train.models.factory import drafter_class
from train.models.model import DFlashConfig
from train.tools.estimate import estimate_run
from train.tools.evaluate import propose

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, VOCAB, LAYERS, BLOCK = 128, 768, 3, 8


def drafter(arch: str) -> Any:
    torch.manual_seed(0)
    heads = max(4, HIDDEN // 32)
    cfg = DFlashConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
                       head_dim=32, intermediate_size=2 * HIDDEN, vocab_size=VOCAB, block_size=BLOCK,
                       mask_token_id=VOCAB - 1, target_layer_ids=[1, 2, 3], num_target_layers=6, arch=arch)
    g = torch.Generator().manual_seed(0)
    head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    return drafter_class(cfg)(cfg, head, head, attention="sdpa").train()


def batch(rows: int = 2, length: int = 256) -> Batch:
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(length)
    return Batch(features=torch.randn(rows, length, LAYERS * HIDDEN, generator=g).to(torch.bfloat16),
                 input_ids=torch.randint(0, VOCAB - 1, (rows, length), generator=g),
                 loss_mask=(pos >= 16).expand(rows, length).clone(), doc_ids=torch.zeros(rows, length, dtype=torch.int32),
                 position_ids=pos.expand(rows, length).clone(), sample_ids=torch.arange(rows), bucket=0, epoch=0,
                 index=0, n_tokens=rows * length, n_padded=0, seed=2)


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    global HIDDEN, VOCAB  # the shape of both drafters and the batch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="training steps timed per round and family")
    ap.add_argument("--drafts", type=int, default=20, help="block drafts timed per round and family")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="drafter (and target) hidden size")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="target vocabulary")
    ap.add_argument("--out", default=str(RESULTS / "bench_dflash2.json"))
    args = ap.parse_args()
    HIDDEN, VOCAB = args.hidden, args.vocab
    torch.set_num_threads(1)
    tcfg = TrainConfig(num_anchors=32, optimizer="adamw")
    b = batch()
    setups = {}
    for arch in ("dflash", "dflash2"):
        model = drafter(arch)
        opt = build_optimizer(tcfg, model)
        lm = LossModule(model, tcfg.num_anchors, None, tcfg.logits_chunk_rows)
        lm.selector = build_selector_loss(tcfg, model)
        args_ = (lm, opt, build_scheduler(tcfg, opt, 10_000), SpikeGuard(GuardsConfig(window=16, min_history=1000)),
                 tcfg, Distributed())
        train_step(0, [b], *args_)  # warm-up
        setups[arch] = (model, args_)
    ctx = b.features[0, :256].float()
    step_s: dict[str, list[float]] = {"dflash": [], "dflash2": []}
    draft_s: dict[str, list[float]] = {"dflash": [], "dflash2": []}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for arch in (("dflash", "dflash2") if r % 2 == 0 else ("dflash2", "dflash")):
            model, step_args = setups[arch]
            t0 = time.process_time()
            for s in range(args.steps):
                train_step(s + 1, [b], *step_args)
            step_s[arch].append((time.process_time() - t0) / args.steps)
            model.eval()
            t0 = time.process_time()
            for _ in range(args.drafts):
                propose(model, ctx, 5)
            draft_s[arch].append((time.process_time() - t0) / args.drafts)
            model.train()
    ratio_step = [a / b_ for a, b_ in zip(step_s["dflash2"], step_s["dflash"], strict=True)]
    ratio_draft = [a / b_ for a, b_ in zip(draft_s["dflash2"], draft_s["dflash"], strict=True)]
    peaks = {}
    for preset in ("qwen3.6-27b", "qwen3.6-27b-dflash2"):
        rep = estimate_run(load_config(ROOT / "configs" / f"{preset}.toml"), device="cuda", gpu_memory_gib=96)
        peaks[preset] = {"peak_gib": round(rep.peak.device_peak / 2**30, 2), "fits_96_gib": rep.fits}
    out = {
        "shape": {"hidden": HIDDEN, "vocab": VOCAB, "layers": 2, "intermediate": 2 * HIDDEN, "block_size": BLOCK, "selector_top_k": 256,
                  "selector_rank": 16, "conv_kernel_size": 2, "conv_group_size": 16, "context_tokens": 512,
                  "anchors_per_step": "32 per document, 2 documents"},
        "timer": "process CPU time, one torch thread", "rounds": args.rounds,
        "train_step_s": {k: summarize(v) for k, v in step_s.items()},
        "draft_block_s": {k: summarize(v) for k, v in draft_s.items()},
        "dflash2_over_dflash": {"train_step": summarize(ratio_step), "draft_block": summarize(ratio_draft)},
        "estimate_27b_presets": peaks,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

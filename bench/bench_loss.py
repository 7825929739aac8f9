"""Chunked vs unchunked loss: time and peak memory at a shape where both fit on a CPU.

"Unchunked" is the loss head as it was before ``train.models.objective.ChunkedCrossEntropy``: the
full-vocabulary logits of every counted block row at once, ``F.cross_entropy`` on their ``.float()``
copy, autograd through it, and the greedy predictions from the same logits. It is written here, as the
reference, over the same hidden states, frozen lm_head, targets and row weights as the chunked head.

Two measurements, each variant run interleaved with the others (ABC, CBA, ABC ...) so that the load of a
shared machine falls on all of them alike; one intra-op thread, so the training thread's CPU time is the
work done (the primary figure; wall time is reported beside it):

* **head**: forward + backward of the loss head alone, hidden [N, H] -> scalar, at N counted rows, in fp32
  (the CPU training dtype) and bf16 (the GPU's autocast dtype: there the unchunked head holds bf16 logits, their
  fp32 copy and the fp32 log-softmax). Peak memory (tensors allocated while it runs,
  ``train.components.memory.peak_memory_bytes``) of the same call.
* **step**: a whole fp32 drafter step (``dflash_loss`` forward + backward through a drafter of the same
  hidden size and vocabulary) with the product's chunked head vs the same step with the unchunked head.

Each run also checks that both heads give the same loss, gradient and predictions.

    .venv/bin/python bench/bench_loss.py [--rows 4096 --hidden 512 --vocab 32000 --chunks 512,1024,2048]
                                         [--repeats 3] [--dtypes float32,bfloat16] [--skip-step]

Prints the figures and writes bench/results/bench_loss.json (``--out`` to change).
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
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.components.memory import peak_memory_bytes  # noqa: E402
from train.models.model import DFlashConfig, DFlashDrafter  # noqa: E402
from train.models.objective import (  # noqa: E402
    FlatBatch,
    LossOutput,
    block_metrics,
    build_blocks,
    chunked_cross_entropy,
    default_gamma,
    dflash_loss,
    loss_weights,
    run_blocks,
    sample_anchors,
)

GOAL_TIME_RATIO = 1.10  # chunked / unchunked, at most
GOAL_MEMORY_RATIO = 8.0  # unchunked / chunked peak of the loss part, at least


# ----------------------------------------------------------------------------------------------
# The reference: the unchunked loss head
# ----------------------------------------------------------------------------------------------


def unchunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor,
                            row_weights: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum of row_weights * CE [], argmax [N])`` with all N rows' logits [N, V] at once, CE on their fp32
    copy (the previous loss head)."""
    logits = hidden @ weight.to(hidden.dtype).t()  # [N, V] in hidden's dtype
    ce = F.cross_entropy(logits.float(), targets, reduction="none")  # [N] fp32
    return (ce * row_weights.float()).sum(), logits.detach().argmax(-1)


def chunked_weighted_ce(hidden: Tensor, weight: Tensor, targets: Tensor, row_weights: Tensor,
                        chunk: int) -> tuple[Tensor, Tensor]:
    """The chunked head as the loss uses it: ``(sum of row_weights * CE [], argmax [N])``."""
    ce, pred = chunked_cross_entropy(hidden, weight, targets, chunk)  # [N] fp32, [N]
    return (ce * row_weights.float()).sum(), pred


def unchunked_dflash_loss(model: DFlashDrafter, batch: Any, *, num_anchors: int, gamma: float | None = None) -> LossOutput:
    """``train.models.objective.dflash_loss`` with the unchunked head: same anchors, blocks, weights and metrics."""
    B = model.config.block_size
    gamma = default_gamma(B) if gamma is None else gamma
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, torch.Generator().manual_seed(int(batch.seed)))
    blocks = build_blocks(flat, anchors, B, model.config.mask_token_id)
    rows = blocks.row_valid.reshape(-1).nonzero().flatten()  # [N] counted rows
    hidden, blocks = run_blocks(model, batch, blocks)  # [A, B, H]
    w = loss_weights(B, gamma, hidden.device).expand_as(blocks.row_valid) * blocks.row_valid  # [A, B]
    loss_sum, pred_rows = unchunked_cross_entropy(hidden.reshape(-1, hidden.shape[-1])[rows], model.lm_head,
                                                  blocks.targets.reshape(-1)[rows], w.reshape(-1)[rows])
    total_w = w.sum()
    pred = torch.full_like(blocks.targets, -1)
    pred.view(-1)[rows] = pred_rows
    metrics = block_metrics(pred, blocks)
    loss = loss_sum / total_w.clamp(min=1e-6)
    metrics["loss"] = loss.detach()
    return LossOutput(loss=loss, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of fn()."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def interleaved(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Each variant once untimed (warm-up), then ``repeats`` rounds, the order reversed every other round.
    Returns per variant the wall and CPU seconds of each round and the 1-minute load average before it."""
    names = list(variants)
    for name in names:
        variants[name]()
    out: dict[str, dict[str, list[float]]] = {n: {"wall_s": [], "cpu_s": [], "loadavg_1m": []} for n in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            load = os.getloadavg()[0]
            wall, cpu = timed(variants[name])
            out[name]["wall_s"].append(wall)
            out[name]["cpu_s"].append(cpu)
            out[name]["loadavg_1m"].append(load)
    return out


def ratios(runs: dict[str, dict[str, list[float]]], base: str, key: str) -> dict[str, dict[str, float]]:
    """Per variant: summary of (variant / base) taken round by round (both ran back to back)."""
    return {name: summary([a / b for a, b in zip(r[key], runs[base][key], strict=True)])
            for name, r in runs.items() if name != base}


# ----------------------------------------------------------------------------------------------
# The loss head alone
# ----------------------------------------------------------------------------------------------


def head_inputs(rows: int, hidden_size: int, vocab: int, block_size: int, dtype: torch.dtype,
                seed: int = 0) -> SimpleNamespace:
    """Final hidden states of ``rows`` counted block rows (unit RMS, as after the final RMSNorm), an lm_head
    at a trained model's scale, targets, and the recipe's weights exp(-(k-1)/gamma) for rows k = 1..B-1."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=g).to(dtype).requires_grad_(True)  # [N, H]
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).to(dtype)  # [V, H]
    targets = torch.randint(0, vocab, (rows,), generator=g)  # [N]
    k = torch.arange(rows) % (block_size - 1) + 1  # block position of each row, 1..B-1
    row_weights = torch.exp(-(k - 1).float() / default_gamma(block_size))  # [N]
    return SimpleNamespace(hidden=hidden, weight=weight, targets=targets, row_weights=row_weights)


def head_variants(x: SimpleNamespace, chunks: list[int]) -> dict[str, Callable[[], Any]]:
    def run(head: Callable[[], tuple[Tensor, Tensor]]) -> Callable[[], Tensor]:
        def step() -> Tensor:
            x.hidden.grad = None
            loss, pred = head()
            loss.backward()
            return pred
        return step

    variants = {"unchunked": run(lambda: unchunked_cross_entropy(x.hidden, x.weight, x.targets, x.row_weights))}
    for c in chunks:
        variants[f"chunked_{c}"] = run(lambda c=c: chunked_weighted_ce(x.hidden, x.weight, x.targets,
                                                                       x.row_weights, c))
    return variants


def head_agreement(x: SimpleNamespace, chunk: int) -> dict[str, float]:
    """How far the chunked head is from the unchunked one: loss (relative), gradient (max abs, relative to
    the largest entry), and the share of rows with a different prediction."""
    out = []
    for head in (lambda: unchunked_cross_entropy(x.hidden, x.weight, x.targets, x.row_weights),
                 lambda: chunked_weighted_ce(x.hidden, x.weight, x.targets, x.row_weights, chunk)):
        x.hidden.grad = None
        loss, pred = head()
        loss.backward()
        out.append((loss.detach().double(), x.hidden.grad.double().clone(), pred))
    (l0, g0, p0), (l1, g1, p1) = out
    return {"loss_rel_diff": float((l1 - l0).abs() / l0.abs()),
            "grad_max_abs_diff_over_max": float((g1 - g0).abs().max() / g0.abs().max()),
            "pred_mismatch_fraction": float((p0 != p1).double().mean())}


def bench_head(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    x = head_inputs(args.rows, args.hidden, args.vocab, args.block_size, dtype)
    variants = head_variants(x, args.chunks)
    memory: dict[str, int] = {}
    for name, fn in variants.items():  # before the timings: the profiler's own cost never lands in them
        memory[name], _ = peak_memory_bytes(fn)
    runs = interleaved(variants, args.repeats)
    logits_bytes = args.rows * args.vocab * dtype.itemsize
    return {
        "shape": {"rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "block_size": args.block_size,
                  "dtype": str(dtype).removeprefix("torch."), "chunks": args.chunks},
        "flops_per_call": 4 * args.rows * args.hidden * args.vocab,  # logits matmul + grad matmul
        "one_copy_of_all_logits_bytes": logits_bytes,
        "peak_bytes": memory,
        "memory_ratio_unchunked_over_chunked": {n: memory["unchunked"] / m for n, m in memory.items()
                                                if n != "unchunked"},
        "cpu_s": {n: summary(r["cpu_s"]) for n, r in runs.items()},
        "wall_s": {n: summary(r["wall_s"]) for n, r in runs.items()},
        "time_ratio_cpu": ratios(runs, "unchunked", "cpu_s"),
        "time_ratio_wall": ratios(runs, "unchunked", "wall_s"),
        "loadavg_1m": summary([v for r in runs.values() for v in r["loadavg_1m"]]),
        "agreement": {f"chunked_{c}": head_agreement(x, c) for c in args.chunks},
    }


# ----------------------------------------------------------------------------------------------
# A whole drafter step
# ----------------------------------------------------------------------------------------------


def step_model(hidden: int, vocab: int, layers: int, block_size: int, dtype: torch.dtype) -> DFlashDrafter:
    heads = max(1, hidden // 64)
    cfg = DFlashConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 4), head_dim=64, intermediate_size=3 * hidden,
                       vocab_size=vocab, block_size=block_size, mask_token_id=vocab - 1,
                       target_layer_ids=[1, 2, 3], num_target_layers=6)
    g = torch.Generator().manual_seed(0)
    embed = (torch.randn(vocab, hidden, generator=g) * 0.05).to(dtype)
    head = (torch.randn(vocab, hidden, generator=g) * 0.05).to(dtype)
    torch.manual_seed(0)
    return DFlashDrafter(cfg, embed, head, attention="sdpa").to(dtype).train()


def step_batch(docs: int, doc_len: int, n_feat: int, vocab: int, dtype: torch.dtype) -> SimpleNamespace:
    """One row of ``docs`` packed documents of ``doc_len`` tokens; the loss mask is on the last 3/4 of
    each document (a prompt, then the response)."""
    g = torch.Generator().manual_seed(1)
    T = docs * doc_len
    doc_ids = (torch.arange(T) // doc_len).to(torch.int32)
    pos = torch.arange(T) % doc_len
    return SimpleNamespace(
        features=torch.randn(1, T, n_feat, generator=g).to(dtype),
        input_ids=torch.randint(0, vocab - 1, (1, T), generator=g),
        loss_mask=(pos >= doc_len // 4).view(1, T),
        doc_ids=doc_ids.view(1, T), position_ids=pos.view(1, T), seed=0)


def bench_step(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    model = step_model(args.hidden, args.vocab, args.layers, args.block_size, dtype)
    batch = step_batch(args.docs, args.doc_len, 3 * args.hidden, args.vocab, dtype)
    chunk = args.step_chunk

    def run(loss_fn: Callable[[], LossOutput]) -> Callable[[], LossOutput]:
        def step() -> LossOutput:
            model.zero_grad(set_to_none=True)
            out = loss_fn()
            out.loss.backward()
            return out
        return step

    variants = {
        "unchunked": run(lambda: unchunked_dflash_loss(model, batch, num_anchors=args.anchors)),
        f"chunked_{chunk}": run(lambda: dflash_loss(model, batch, num_anchors=args.anchors, chunk_rows=chunk)),
    }
    # agreement: loss, every parameter's gradient and the metrics
    ref = variants["unchunked"]()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = variants[f"chunked_{chunk}"]()
    grad_diff = max(float((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-30))
                    for n, p in model.named_parameters())
    same_metrics = all(torch.equal(out.metrics[k], ref.metrics[k])
                       for k in ("n_blocks", "accepted_sum", "position_correct", "position_count"))
    n_blocks = int(out.metrics["n_blocks"])
    counted = int(out.metrics["position_count"].sum())
    memory = {name: peak_memory_bytes(fn)[0] for name, fn in variants.items()}
    runs = interleaved(variants, args.repeats)
    return {
        "shape": {"hidden": args.hidden, "vocab": args.vocab, "layers": args.layers, "block_size": args.block_size,
                  "heads": model.config.num_attention_heads, "kv_heads": model.config.num_key_value_heads,
                  "head_dim": model.config.head_dim, "intermediate": model.config.intermediate_size,
                  "context_tokens": args.docs * args.doc_len, "docs": args.docs, "num_anchors_per_doc": args.anchors,
                  "blocks": n_blocks, "block_rows": n_blocks * args.block_size, "counted_rows": counted,
                  "chunk_rows": chunk, "dtype": str(dtype).removeprefix("torch."), "attention": "sdpa"},
        "peak_bytes": memory,
        "memory_ratio_unchunked_over_chunked": memory["unchunked"] / memory[f"chunked_{chunk}"],
        "cpu_s": {n: summary(r["cpu_s"]) for n, r in runs.items()},
        "wall_s": {n: summary(r["wall_s"]) for n, r in runs.items()},
        "time_ratio_cpu": ratios(runs, "unchunked", "cpu_s"),
        "time_ratio_wall": ratios(runs, "unchunked", "wall_s"),
        "loadavg_1m": summary([v for r in runs.values() for v in r["loadavg_1m"]]),
        "agreement": {"loss_rel_diff": float((out.loss.detach() - ref.loss.detach()).abs() / ref.loss.detach().abs()),
                      "grad_max_abs_diff_over_max": grad_diff, "metrics_equal": same_metrics},
    }


def report(results: dict) -> None:
    for part, r in results.items():
        if not part.startswith(("head", "step")):
            continue
        print(f"[{part}] " + " ".join(f"{k}={v}" for k, v in r["shape"].items()))
        print(f"  load average 1m: median {r['loadavg_1m']['median']:.2f} "
              f"({r['loadavg_1m']['min']:.2f}-{r['loadavg_1m']['max']:.2f})")
        for name in r["cpu_s"]:
            c, w = r["cpu_s"][name], r["wall_s"][name]
            line = (f"  {name:>14}: cpu {c['median']:.3f} s ({c['min']:.3f}-{c['max']:.3f}), "
                    f"wall {w['median']:.3f} s ({w['min']:.3f}-{w['max']:.3f}), peak {r['peak_bytes'][name] / 2**20:.0f} MiB")
            if name in r["time_ratio_cpu"]:
                q = r["time_ratio_cpu"][name]
                mem = r["memory_ratio_unchunked_over_chunked"]
                mem = mem[name] if isinstance(mem, dict) else mem
                line += (f"; time/unchunked {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}),"
                         f" memory unchunked/this {mem:.1f}x")
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="counted block rows of the head benchmark")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[512, 1024, 2048])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"],
                    help="dtypes of the head benchmark (the step runs in float32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-step", action="store_true", help="the loss head only")
    ap.add_argument("--layers", type=int, default=2, help="drafter layers of the step benchmark")
    ap.add_argument("--docs", type=int, default=2, help="documents packed in the step's one row")
    ap.add_argument("--doc-len", type=int, default=512)
    ap.add_argument("--anchors", type=int, default=160, help="anchors per document in the step benchmark")
    ap.add_argument("--step-chunk", type=int, default=1024, help="chunk_rows of the step benchmark")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_loss.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg(),
        "goals": {"time_ratio_max": GOAL_TIME_RATIO, "memory_ratio_min": GOAL_MEMORY_RATIO},
        "note": "interleaved runs on a shared machine; cpu_s is this thread's CPU time (one intra-op thread)",
    }
    for name in args.dtypes:
        results[f"head_{name}"] = bench_head(args, getattr(torch, name))
    if not args.skip_step:
        results["step"] = bench_step(args, torch.float32)
    results["loadavg_end"] = os.getloadavg()
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

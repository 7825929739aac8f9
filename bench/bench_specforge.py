"""Drafter forward+backward vs SpecForge's ``OnlineDFlashModel`` at one tiny shape, one thread, same weights,
same anchors; the losses compared.

SpecForge is not a dependency of this project. Install it, without its dependencies, into a scratch virtual
environment outside the repository that also sees this project's packages, e.g.

    python3 -m venv /tmp/sfvenv && /tmp/sfvenv/bin/pip install --no-deps specforge
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /tmp/sfvenv/lib/python3.11/site-packages/project.pth
    /tmp/sfvenv/bin/python bench/bench_specforge.py

Without SpecForge importable the script says so and exits 0 (nothing written).

What is compared, on one row holding one document (so that the two anchor rules coincide):

* **weights**: SpecForge's ``DFlashDraftModel`` is built from the same architecture (a ``Qwen3Config``) and
  loads this drafter's ``state_dict()`` under the same names, strictly; the frozen embedding and lm_head are the
  same tensors (``nn.Embedding`` / ``nn.Linear`` there, buffers here).
* **anchors**: this project's ``dflash_loss`` draws them per document (``sample_anchors``, seeded by
  ``batch.seed``); SpecForge draws per row with the global RNG. Its anchor sampler is replaced, in the bench, by
  one returning the anchors this project draws, so both run the same blocks. The eligibility rule is the same
  on one document (loss mask on at a and a+1).
* **loss**: both are the weighted mean of CE over block rows 1..B-1 at the same positions (no shift) with
  weight exp(-(k-1)/gamma), rows past the sequence or off the loss mask weigh 0. SpecForge computes CE over
  every row (``log_softmax`` + NLL) and sums all of them, zero weights included; this project forms each counted
  row's ``logsumexp - z_target`` and sums the counted rows only. Both round differently in the last bit or two,
  so the losses agree to rounding, not bitwise; the bench reports whether the drafters' outputs are bitwise
  equal (they are: the difference is in the loss head alone), the unchunked head's loss beside them, and the
  gradient of every parameter.
* **time**: a whole ``loss.backward()`` step each (this project's includes drawing the anchors; SpecForge's
  takes them precomputed), and this project's step with the unchunked loss head (``bench_loss``'s reference),
  interleaved round by round; each round times ``--steps`` consecutive steps. CPU time of the one thread is
  the primary figure, wall time beside it.

    /tmp/sfvenv/bin/python bench/bench_specforge.py [--repeats 5] [--steps 5] [--out PATH]

Writes bench/results/bench_specforge.json.
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
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loss import unchunked_dflash_loss  # noqa: E402

from train.models.model import DFlashConfig, DFlashDrafter  # noqa: E402
from train.models.objective import (  # noqa: E402
    ExpDecayWeighting,
    FlatBatch,
    default_gamma,
    dflash_loss,
    forward_blocks,
    sample_anchors,
)

GOAL_TIME_RATIO = 1.0  # ours / SpecForge's, at most


def import_specforge() -> tuple[Any, Any] | str:
    """``(DFlashDraftModel, OnlineDFlashModel)``, or why they cannot be imported."""
    try:
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
    except ImportError as err:
        return f"specforge is not importable here ({err})"
    return DFlashDraftModel, OnlineDFlashModel


def our_drafter(args: argparse.Namespace) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                       intermediate_size=args.intermediate, vocab_size=args.vocab, block_size=args.block_size,
                       mask_token_id=args.vocab - 1, target_layer_ids=[1, 3, 5], num_target_layers=8,
                       rope_theta=1_000_000.0)
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(args.vocab, args.hidden, generator=g) * 0.05
    head = torch.randn(args.vocab, args.hidden, generator=g) * 0.05
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, embed, head, attention="sdpa").train()
    # non-trivial norm weights, so that a swapped or missed norm shows in the comparison
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def their_drafter(ours: DFlashDrafter, draft_cls: Any) -> nn.Module:
    """SpecForge's drafter with the same architecture and weights (strict load under the same names)."""
    from transformers import Qwen3Config

    c = ours.config
    qcfg = Qwen3Config(
        hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, attention_bias=False,
        layer_types=["full_attention"] * c.num_hidden_layers, hidden_act="silu",
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    qcfg.block_size = c.block_size
    qcfg.num_target_layers = c.num_target_layers
    qcfg.dflash_config = {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id}
    theirs = draft_cls(qcfg).float().train()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs


def their_wrapper(ours: DFlashDrafter, draft: nn.Module, online_cls: Any, anchors: Tensor, gamma: float,
                  num_anchors: int) -> nn.Module:
    """SpecForge's online wrapper around ``draft``, its anchor sampler returning ``anchors`` [A] (row positions)."""

    class SameAnchors(online_cls):  # type: ignore[misc, valid-type]
        def _sample_anchor_positions(self, seq_len: int, loss_mask: Tensor, device: torch.device):
            a = anchors.view(1, -1).to(device)
            return a, torch.ones_like(a, dtype=torch.bool)

    V, H = ours.lm_head.shape
    lm_head = nn.Linear(H, V, bias=False)
    embed = nn.Embedding(V, H)
    with torch.no_grad():
        lm_head.weight.copy_(ours.lm_head)
        embed.weight.copy_(ours.embed_tokens)
    lm_head.requires_grad_(False)
    embed.requires_grad_(False)
    return SameAnchors(draft_model=draft, target_lm_head=lm_head, target_embed_tokens=embed,
                       mask_token_id=ours.config.mask_token_id, block_size=ours.config.block_size,
                       attention_backend="sdpa", num_anchors=num_anchors, loss_decay_gamma=gamma)


def one_document(seq_len: int, n_feat: int, vocab: int, seed: int = 1) -> SimpleNamespace:
    """One row, one document: a prompt (first quarter, off the loss mask) and a response."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq_len)
    return SimpleNamespace(
        features=torch.randn(1, seq_len, n_feat, generator=g).to(torch.bfloat16),
        input_ids=torch.randint(0, vocab - 1, (1, seq_len), generator=g),
        loss_mask=(pos >= seq_len // 4).view(1, seq_len),
        doc_ids=torch.zeros(1, seq_len, dtype=torch.int32), position_ids=pos.view(1, seq_len), seed=0)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def compare(args: argparse.Namespace, ours: DFlashDrafter, theirs_model: nn.Module, theirs: nn.Module,
            batch: SimpleNamespace, features: Tensor, loss_mask: Tensor, gamma: float) -> dict[str, Any]:
    ours.zero_grad(set_to_none=True)
    out = dflash_loss(ours, batch, num_anchors=args.anchors, weighting=ExpDecayWeighting(gamma),
                        chunk_rows=args.chunk_rows)
    out.loss.backward()
    theirs_model.zero_grad(set_to_none=True)
    t_loss, t_acc, _ = theirs(batch.input_ids, features, loss_mask)
    t_loss.backward()
    o_params, t_params = dict(ours.named_parameters()), dict(theirs_model.named_parameters())
    grad_rel = {n: float((o_params[n].grad - t_params[n].grad).abs().max() / t_params[n].grad.abs().max())
                for n in o_params}
    worst = max(grad_rel, key=grad_rel.get)
    o_loss, t_loss_f = out.loss.item(), t_loss.item()
    m = out.metrics
    o_acc = float(m["position_correct"].sum() / m["position_count"].sum())
    with torch.no_grad():  # where a difference comes from: the drafters' outputs, or the loss heads
        flat = FlatBatch.of(batch)
        anchors = sample_anchors(flat.eligible, flat.docs, args.anchors, torch.Generator().manual_seed(batch.seed))
        h_ours, _ = forward_blocks(ours, batch, flat, anchors)  # [A, B, H]
        h_theirs = theirs._forward_draft_blocks(batch.input_ids, features, loss_mask)[2]  # [1, A*B, H]
        unchunked = unchunked_dflash_loss(ours, batch, num_anchors=args.anchors, gamma=gamma).loss.item()
    return {
        "drafter_hidden_bitwise_equal": torch.equal(h_ours.reshape(-1), h_theirs.reshape(-1)),
        "drafter_hidden_max_abs_diff": float((h_ours.reshape(-1) - h_theirs.reshape(-1)).abs().max()),
        "loss_ours": o_loss, "loss_ours_unchunked": unchunked, "loss_specforge": t_loss_f,
        "loss_bitwise_equal": o_loss == t_loss_f, "loss_rel_diff": abs(o_loss - t_loss_f) / abs(t_loss_f),
        "loss_ulps_apart": abs(o_loss - t_loss_f) / torch.finfo(torch.float32).eps / abs(t_loss_f),
        "accuracy_ours": o_acc, "accuracy_specforge": float(t_acc),
        "grad_max_rel_diff": grad_rel[worst], "grad_max_rel_diff_param": worst,
    }


def timed_rounds(variants: dict[str, Callable[[], Any]], repeats: int, steps: int) -> dict[str, dict[str, list]]:
    """One untimed call of each, then ``repeats`` rounds (order reversed every other round), each timing
    ``steps`` consecutive calls; seconds per call."""
    names = list(variants)
    for n in names:
        variants[n]()
    out: dict[str, dict[str, list]] = {n: {"cpu_s": [], "wall_s": [], "loadavg_1m": []} for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            out[n]["loadavg_1m"].append(os.getloadavg()[0])
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                variants[n]()
            out[n]["wall_s"].append((time.perf_counter() - t0) / steps)
            out[n]["cpu_s"].append((time.thread_time() - c0) / steps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--chunk-rows", type=int, default=2048, help="this project's logits chunk (train default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="consecutive steps timed per round")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_specforge.json")
    args = ap.parse_args()
    found = import_specforge()
    if isinstance(found, str):
        print(f"skipped: {found}; see this script's docstring to install it into a scratch environment")
        return 0
    draft_cls, online_cls = found
    torch.set_num_threads(1)

    ours = our_drafter(args)
    theirs_model = their_drafter(ours, draft_cls)
    n_feat = len(ours.config.target_layer_ids) * args.hidden
    batch = one_document(args.seq_len, n_feat, args.vocab)
    gamma = default_gamma(args.block_size)
    flat = FlatBatch.of(batch)
    # the anchors dflash_loss draws for this batch (same function, same seed)
    anchors = sample_anchors(flat.eligible, flat.docs, args.anchors, torch.Generator().manual_seed(batch.seed))
    theirs = their_wrapper(ours, theirs_model, online_cls, anchors, gamma, args.anchors)
    features = batch.features.float()  # SpecForge takes the fp32 features the model computes in
    loss_mask = batch.loss_mask.float()

    agreement = compare(args, ours, theirs_model, theirs, batch, features, loss_mask, gamma)

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        dflash_loss(ours, batch, num_anchors=args.anchors, weighting=ExpDecayWeighting(gamma),
                        chunk_rows=args.chunk_rows).loss.backward()

    def ours_unchunked_step() -> None:
        ours.zero_grad(set_to_none=True)
        unchunked_dflash_loss(ours, batch, num_anchors=args.anchors, gamma=gamma).loss.backward()

    def theirs_step() -> None:
        theirs_model.zero_grad(set_to_none=True)
        theirs(batch.input_ids, features, loss_mask)[0].backward()

    load_start = os.getloadavg()
    runs = timed_rounds({"ours": ours_step, "ours_unchunked": ours_unchunked_step, "specforge": theirs_step},
                        args.repeats, args.steps)
    ratio = {k: summary([a / b for a, b in zip(runs["ours"][k], runs["specforge"][k], strict=True)])
             for k in ("cpu_s", "wall_s")}
    ratio_unchunked = summary([a / b for a, b in zip(runs["ours_unchunked"]["cpu_s"], runs["specforge"]["cpu_s"],
                                                     strict=True)])
    import specforge  # noqa: PLC0415 - only for its version, once it is known to import

    results = {
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "specforge": getattr(specforge, "__version__", None) or _dist_version("specforge"),
        "shape": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "head_dim": args.head_dim, "intermediate": args.intermediate, "vocab": args.vocab,
                  "block_size": args.block_size, "rows": 1, "docs": 1, "seq_len": args.seq_len,
                  "blocks": int(anchors.numel()), "gamma": gamma, "chunk_rows_ours": args.chunk_rows,
                  "objective_chunk_blocks_specforge": theirs.objective_chunk_blocks, "dtype": "float32",
                  "attention": "sdpa (both)"},
        "agreement": agreement,
        "cpu_s_per_step": {n: summary(r["cpu_s"]) for n, r in runs.items()},
        "wall_s_per_step": {n: summary(r["wall_s"]) for n, r in runs.items()},
        "ratio_ours_over_specforge": ratio,
        "ratio_ours_unchunked_over_specforge_cpu": ratio_unchunked,
        "goal_ratio_max": GOAL_TIME_RATIO,
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "loadavg_1m": summary([v for r in runs.values() for v in r["loadavg_1m"]]),
        "note": "interleaved rounds on a shared machine; cpu_s is the one intra-op thread's CPU time",
    }
    for k, v in agreement.items():
        print(f"  {k}: {v}")
    for n in runs:
        c, w = results["cpu_s_per_step"][n], results["wall_s_per_step"][n]
        print(f"  {n:>15}: cpu {c['median'] * 1e3:.1f} ms ({c['min'] * 1e3:.1f}-{c['max'] * 1e3:.1f}), "
              f"wall {w['median'] * 1e3:.1f} ms ({w['min'] * 1e3:.1f}-{w['max'] * 1e3:.1f})")
    r = ratio["cpu_s"]
    print(f"  ours / specforge (cpu): {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}); load average "
          f"{results['loadavg_1m']['median']:.2f} ({results['loadavg_1m']['min']:.2f}-{results['loadavg_1m']['max']:.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())

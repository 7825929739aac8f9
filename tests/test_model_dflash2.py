"""DFlash2: the block-local dynamic convolution, the candidate selector, the chunked unary head with top-K and the
selector loss, each against a direct computation written here (per-block / per-row loops), and training through
``dflash-train --set model.arch=dflash2``."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from fixtures.drafters import tiny_batch, tiny_config, tiny_head
from fixtures.trainer import CONFIG, ROOT, run_train, small_cache

from train.models.dflash2 import DFlash2Drafter, GroupedDynamicConv, SelectorLoss, UnaryTopK, dflash2_loss
from train.models.model import DFlashDrafter
from train.models.objective import FlatBatch, build_blocks, default_gamma, forward_blocks, sample_anchors
from train.tools.evaluate import cli_main as eval_main
from train.tools.export import cli_main as export_main


def dflash2_drafter(seed: int = 0, **overrides) -> DFlash2Drafter:
    """A tiny DFlash2 drafter whose convolutions and selector are random (not the identity-like init)."""
    torch.manual_seed(seed)
    kw = dict(arch="dflash2", conv_kernel_size=3, conv_group_size=16, selector_top_k=8, selector_rank=4)
    cfg = tiny_config(**{**kw, **overrides})
    embed, lm_head = tiny_head(seed, cfg.vocab_size, cfg.hidden_size)
    model = DFlash2Drafter(cfg, embed, lm_head, attention="sdpa").eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "base_kernel" in name else 0.1))
    return model


# ----------------------------------------------------------------------------------------------
# Direct computations
# ----------------------------------------------------------------------------------------------


def naive_conv(x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [A, B, H], taps [A, B, K, G], base [K, H]: one block at a time, one position and tap at a time."""
    A, B, H = x.shape
    out = torch.zeros_like(x)
    for a in range(A):
        for t in range(B):
            for o in range(base.shape[0]):
                if t - o >= 0:  # never before the block's first row
                    kernel = base[o] + taps[a, t, o].repeat_interleave(group_size)  # [H]
                    out[a, t] += kernel * x[a, t - o]
    return out


def transform(z: torch.Tensor, mult: float, cap: float | None) -> torch.Tensor:
    z = z * mult
    return cap * torch.tanh(z / cap) if cap is not None else z


def naive_selector_ce(model: DFlash2Drafter, h: torch.Tensor, prev: int, gold: int, rule: str) -> torch.Tensor | None:
    """One row: top-K of the transformed unary logits, each candidate rescored by the bilinear term, CE of gold."""
    sel = model.candidate_selector
    cfg = model.config
    z = transform(h @ model.lm_head.t(), cfg.output_multiplier, cfg.final_logit_softcapping)  # [V]
    vals, cand = z.topk(sel.top_k)
    proj = sel.hidden_projection.weight @ h  # [r]
    pred_code = sel.predecessor_codebook.weight[prev]
    scores = [vals[j] + (pred_code * proj * sel.successor_codebook.weight[int(c)]).sum() for j, c in enumerate(cand)]
    target = [j for j, c in enumerate(cand) if int(c) == gold]
    if not target:
        if rule == "drop":
            return None
        scores.append(z[gold] + (pred_code * proj * sel.successor_codebook.weight[gold]).sum())
        target = [len(scores) - 1]
    scores_t = torch.stack(scores)
    return torch.logsumexp(scores_t, 0) - scores_t[target[0]]


# ----------------------------------------------------------------------------------------------
# The convolution
# ----------------------------------------------------------------------------------------------


def test_grouped_dynamic_conv_matches_a_per_block_loop():
    torch.manual_seed(0)
    A, B, H, K, gs = 3, 5, 32, 3, 8
    conv = GroupedDynamicConv(H, K, gs)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.2)
    x = torch.randn(A, B, H)
    y = torch.randn(A, B, H)
    out, after = conv.prepare(x.reshape(1, A * B, H), B)  # the flat training layout
    fin = conv.finish(y.reshape(1, A * B, H), after, B)
    taps = (x @ conv.kernel_projection.weight.t()).view(A, B, 2, K, H // gs)
    torch.testing.assert_close(out.view(A, B, H), naive_conv(x, taps[:, :, 0], conv.base_kernel[0], gs))
    torch.testing.assert_close(fin.view(A, B, H), naive_conv(y, taps[:, :, 1], conv.base_kernel[1], gs))


def test_conv_never_crosses_a_block_boundary_in_the_drafter():
    """Every block computed together in the flat layout equals each block computed alone (as at inference), and
    changing one block's anchor token changes no other block."""
    model = dflash2_drafter()
    batch = tiny_batch(rows=1, length=40)
    flat = FlatBatch.of(batch)
    anchors = flat.eligible.nonzero().flatten()[[0, 1, 2, 9, 20]]  # adjacent anchors: overlapping positions
    with torch.no_grad():
        together, _ = forward_blocks(model, batch, flat, anchors)  # [5, B, H]
        for i in range(anchors.numel()):
            alone, _ = forward_blocks(model, batch, flat, anchors[i:i + 1])
            torch.testing.assert_close(together[i], alone[0], rtol=1e-5, atol=1e-5)
        blocks = build_blocks(flat, anchors, model.config.block_size, model.config.mask_token_id)
        blocks.block_ids[2, 0] = (blocks.block_ids[2, 0] + 1) % (model.config.vocab_size - 1)
        changed = model(batch.features, blocks.block_ids, blocks.block_positions, blocks.layout)
    assert not torch.allclose(changed[2], together[2])
    others = [0, 1, 3, 4]
    torch.testing.assert_close(changed[others], together[others], rtol=1e-5, atol=1e-5)


def test_a_fresh_dflash2_drafter_computes_what_dflash_computes():
    """Identity base kernels and zero dynamic taps at initialisation: the same hidden states as DFlash."""
    cfg2 = tiny_config(arch="dflash2")
    embed, lm_head = tiny_head(0)
    torch.manual_seed(0)
    d1 = DFlashDrafter(tiny_config(), embed, lm_head, attention="sdpa")
    d2 = DFlash2Drafter(cfg2, embed, lm_head, attention="sdpa")
    d2.load_state_dict({**d2.state_dict(), **d1.state_dict()})
    batch = tiny_batch()
    flat = FlatBatch.of(batch)
    anchors = flat.eligible.nonzero().flatten()[:6]
    with torch.no_grad():
        torch.testing.assert_close(forward_blocks(d2, batch, flat, anchors)[0], forward_blocks(d1, batch, flat, anchors)[0])


# ----------------------------------------------------------------------------------------------
# The chunked unary head
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [3, 5], ids=["gathered-rows-backward", "dense-backward"])  # 8 K < V, 8 K >= V
@pytest.mark.parametrize("mult,cap", [(1.0, None), (1.7, 3.0)])
def test_unary_topk_values_and_gradients_match_autograd(mult, cap, K):
    g = torch.Generator().manual_seed(0)
    N, H, V = 7, 16, 40
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    a, b, c = torch.rand(N, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    ce, pred, top_val, top_idx, gold = UnaryTopK.apply(h, w, targets, K, (mult, cap), 3)  # chunks of 3 rows
    ((ce * a).sum() + (top_val * b).sum() + (gold * c).sum()).backward()
    grad = h.grad.clone()
    h.grad = None
    z = transform(h @ w.t(), mult, cap)  # [N, V]
    ref_ce = F.cross_entropy(z, targets, reduction="none")
    ref_val, ref_idx = z.topk(K, dim=-1)
    ref_gold = z.gather(1, targets[:, None])[:, 0]
    ((ref_ce * a).sum() + (ref_val * b).sum() + (ref_gold * c).sum()).backward()
    torch.testing.assert_close(ce, ref_ce)
    torch.testing.assert_close(top_val, ref_val)
    assert torch.equal(top_idx, ref_idx) and torch.equal(pred, z.argmax(-1))
    torch.testing.assert_close(gold, ref_gold)
    torch.testing.assert_close(grad, h.grad, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The selector loss
# ----------------------------------------------------------------------------------------------


def _naive_loss(model: DFlash2Drafter, batch, rule: str, alpha: float, num_anchors: int) -> tuple[float, int]:
    """The whole DFlash2 loss one row at a time: exp-decay-weighted unary CE + alpha x the selector CE."""
    B = model.config.block_size
    flat = FlatBatch.of(batch)
    anchors = sample_anchors(flat.eligible, flat.docs, num_anchors, torch.Generator().manual_seed(int(batch.seed)))
    hidden, blocks = forward_blocks(model, batch, flat, anchors)
    gamma = default_gamma(B)
    num, den, sel, outside = 0.0, 0.0, 0.0, 0
    cfg = model.config
    for a in range(hidden.shape[0]):
        for k in range(1, B):
            if not blocks.row_valid[a, k]:
                continue
            w = math.exp(-(k - 1) / gamma)
            gold, prev = int(blocks.targets[a, k]), int(blocks.targets[a, k - 1])
            z = transform(hidden[a, k] @ model.lm_head.t(), cfg.output_multiplier, cfg.final_logit_softcapping)
            num += w * float(torch.logsumexp(z, 0) - z[gold])
            den += w
            ce = naive_selector_ce(model, hidden[a, k], prev, gold, rule)
            outside += gold not in z.topk(model.candidate_selector.top_k).indices.tolist()
            if ce is not None:
                sel += w * float(ce)
    return (num + alpha * sel) / den, outside


@pytest.mark.parametrize("rule", ["drop", "append"])
def test_dflash2_loss_matches_a_per_row_computation(rule):
    model = dflash2_drafter(output_multiplier=1.3, final_logit_softcapping=4.0)
    batch = tiny_batch(rows=2, length=40, seed=3)
    with torch.no_grad():
        out = dflash2_loss(model, batch, num_anchors=6, selector=SelectorLoss(0.7, rule), chunk_rows=5)
        expected, outside = _naive_loss(model, batch, rule, 0.7, 6)
    assert outside > 0  # top-8 of 96: some gold tokens are outside, so the rule matters
    assert float(out.loss) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("rule", ["drop", "append"])
def test_selector_topk_recall_is_the_share_of_rows_whose_gold_is_a_candidate(rule):
    """selector/topk_recall (and per position) measures recall under either gold-outside rule: with ``append``
    the gold token is scored as an extra column, yet a row whose gold is outside the unary top-K is still a
    miss (not 1.0). The reference counts rows one at a time against the transformed logits' top-K."""
    from train.models.dflash2 import selector_summary

    model = dflash2_drafter(output_multiplier=1.3, final_logit_softcapping=4.0)
    batch = tiny_batch(rows=2, length=40, seed=3)
    with torch.no_grad():
        out = dflash2_loss(model, batch, num_anchors=6, selector=SelectorLoss(0.7, rule), chunk_rows=5)
        B, cfg = model.config.block_size, model.config
        flat = FlatBatch.of(batch)
        anchors = sample_anchors(flat.eligible, flat.docs, 6, torch.Generator().manual_seed(int(batch.seed)))
        hidden, blocks = forward_blocks(model, batch, flat, anchors)
        hits, rows = [0] * B, [0] * B
        for a in range(hidden.shape[0]):
            for k in range(1, B):
                if blocks.row_valid[a, k]:
                    z = transform(hidden[a, k] @ model.lm_head.t(), cfg.output_multiplier, cfg.final_logit_softcapping)
                    rows[k] += 1
                    hits[k] += int(blocks.targets[a, k]) in z.topk(model.candidate_selector.top_k).indices.tolist()
    summary = selector_summary(out.metrics)
    want = sum(hits) / sum(rows)
    assert 0.0 < want < 1.0  # top-8 of 96: some gold tokens are outside
    assert summary["selector/topk_recall"] == pytest.approx(want, abs=1e-12)
    for k in range(1, B):
        if rows[k]:
            assert summary[f"selector/recall_pos_{k}"] == pytest.approx(hits[k] / rows[k], abs=1e-12)


def _one_row_outside_top_k(rule: str):
    """A single block whose row 1's gold token is not among the top-K: the selector loss and its gradient."""
    model = dflash2_drafter(selector_top_k=2)
    batch = tiny_batch(rows=1, length=40, seed=1)
    flat = FlatBatch.of(batch)
    anchors = flat.eligible.nonzero().flatten()
    with torch.no_grad():
        hidden, blocks = forward_blocks(model, batch, flat, anchors)
        top = model.logits(hidden[:, 1]).topk(2).indices  # [A, 2]
    outside = [i for i in range(anchors.numel()) if int(blocks.targets[i, 1]) not in top[i].tolist()]
    a = outside[0]
    # one block, with only its row 1 on the loss mask
    batch.loss_mask[:] = False
    pos = int(anchors[a])
    batch.loss_mask[0, pos:pos + 2] = True
    out = dflash2_loss(model, batch, num_anchors=4, selector=SelectorLoss(1.0, rule))
    model.zero_grad()
    (out.loss - out.metrics["unary_loss"]).backward()  # the selector part only
    gold = int(blocks.targets[a, 1])
    return out, model.candidate_selector.successor_codebook.weight.grad[gold]


def test_gold_outside_top_k_drop_gives_no_selector_loss():
    out, grad_gold = _one_row_outside_top_k("drop")
    assert float(out.metrics["sums/selector_loss"]) == 0.0
    assert float(out.metrics["sums/selector_topk_hit"].sum()) == 0.0
    assert torch.count_nonzero(grad_gold) == 0


def test_gold_outside_top_k_append_trains_the_gold_token():
    out, grad_gold = _one_row_outside_top_k("append")
    assert float(out.metrics["sums/selector_loss"]) > 0.0
    assert torch.count_nonzero(grad_gold) > 0


@pytest.mark.parametrize("detach", [True, False])
def test_selector_gradient_into_the_backbone_stops_only_when_asked(detach):
    batch = tiny_batch(rows=1, length=40, seed=2)

    def grads(alpha: float) -> dict[str, torch.Tensor]:
        model = dflash2_drafter()
        dflash2_loss(model, batch, num_anchors=6, selector=SelectorLoss(alpha, "append", detach)).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    without, with_sel = grads(0.0), grads(1.0)
    backbone = [n for n in without if "candidate_selector" not in n]
    same = all(torch.allclose(without[n], with_sel[n], rtol=1e-5, atol=1e-7) for n in backbone)
    assert same is detach
    assert torch.count_nonzero(with_sel["candidate_selector.hidden_projection.weight"]) > 0


def test_teacher_forced_selection_and_the_inference_walk_match_a_loop():
    model = dflash2_drafter()
    batch = tiny_batch(rows=1, length=40, seed=4)
    flat = FlatBatch.of(batch)
    anchors = flat.eligible.nonzero().flatten()[:4]
    with torch.no_grad():
        hidden, blocks = forward_blocks(model, batch, flat, anchors)
        forced = model.select_greedy(hidden, blocks, chunk=3)
        for a in range(anchors.numel()):
            walk = model.select_path(hidden[a, 1:], int(blocks.block_ids[a, 0]))
            prev = int(blocks.block_ids[a, 0])
            for k in range(1, model.config.block_size):
                h = hidden[a, k]
                scores = {}
                for cand in model.logits(h).topk(model.candidate_selector.top_k).indices.tolist():
                    ce = naive_selector_ce(model, h, prev, cand, "drop")  # the CE of cand is lowest at the argmax
                    scores[cand] = -float(ce)
                best = max(scores, key=scores.get)
                assert int(walk[k - 1]) == best
                tf_prev = int(blocks.targets[a, k - 1])
                if k == 1 or tf_prev == prev:
                    assert int(forced[a, k]) == best
                prev = best


# ----------------------------------------------------------------------------------------------
# Through the trainer
# ----------------------------------------------------------------------------------------------


def test_dflash_train_trains_a_dflash2_drafter_and_logs_selector_metrics(tmp_path):
    cache = small_cache(str(tmp_path / "cache"), n_samples=24)
    run = tmp_path / "run"
    base = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
            "loader.tokens_per_batch=512", "train.num_anchors=16"]
    run_train(base, cache, run, "model.arch=dflash2", "train.max_steps=3", "checkpoint.every_steps=3",
              "model.selector_top_k=32", timeout=240)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert len(train) == 3
    # every selector tag written is in docs/metrics.md's DFlash2 table, and every one documented there is written
    documented = set()
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| (`[^|]+`) \| train \(dflash2\) \|", line)
        if m:
            documented |= {re.escape(t).replace(re.escape("<k>"), r"[1-7]") for t in re.findall(r"`([^`]+)`", m.group(1))}
    written = {k for r in train for k in r if k.startswith("selector/")}
    assert all(any(re.fullmatch(p, k) for p in documented) for k in written), written
    assert all(any(re.fullmatch(p, k) for k in written) for p in documented), documented
    assert all(math.isfinite(r[k]) for r in train for k in written)
    assert all(0.0 <= r["selector/topk_recall"] <= 1.0 and r["selector/tau"] >= 1.0 for r in train)
    assert train[-1]["selector/unary_tau"] == train[-1]["train/acceptance_length"]
    from safetensors import safe_open

    ckpt = run / "checkpoints" / "step-00000003" / "model.safetensors"
    with safe_open(str(ckpt), framework="pt") as f:
        names = set(f.keys())
    assert "layers.1.mlp_conv.base_kernel" in names
    assert any(n.startswith("candidate_selector.") for n in names)
    # the same run through `dflash-train eval` (the selected path's teacher-forced tau) and `export`
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert eval_main([str(CONFIG), "--cache", cache, "--checkpoint", str(run), "--samples", "all", "--json",
                          "--device", "cpu", "--set", "model.mask_token_id=511"]) == 0
    report = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert 1.0 <= report["acceptance_length"] <= 8 and report["n_blocks"] > 0
    assert export_main([str(run), "--out", str(tmp_path / "export")]) == 0
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"] and exported["dflash_config"]["selector_top_k"] == 32


def test_a_batch_without_blocks_reports_the_same_selector_sums():
    """Data-parallel ranks all-reduce the selector sums: a rank whose batch has no anchor sends zeros of the same
    keys and shapes."""
    model = dflash2_drafter()
    batch = tiny_batch(rows=1, length=40, seed=2)
    full = dflash2_loss(model, batch, num_anchors=4).metrics
    batch.loss_mask[:] = False
    empty = dflash2_loss(model, batch, num_anchors=4).metrics
    keys = sorted(k for k in full if k.startswith("sums/"))
    assert keys == sorted(k for k in empty if k.startswith("sums/"))
    assert all(full[k].shape == empty[k].shape for k in keys)
    assert all(float(empty[k].sum()) == 0 for k in keys if k != "sums/selector_micro")


def test_a_killed_dflash2_run_resumes_bitwise(tmp_path):
    """SIGKILL after the first checkpoint, rerun: the same losses (and selector metrics) as a run never killed."""
    import subprocess

    from fixtures.trainer import ROOT, train_cmd, train_env
    from test_train_run import BASE, _losses, _wait_for

    from train.components.metrics import read_metrics

    cache = small_cache(str(tmp_path / "cache"), n_samples=24)
    recipe = ("model.arch=dflash2", "model.selector_top_k=32", "train.max_steps=6", "checkpoint.every_steps=3")
    straight = tmp_path / "straight"
    run_train(BASE, cache, straight, *recipe, timeout=240)
    run = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(BASE, cache, run, *recipe), cwd=ROOT, env=train_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (run / "checkpoints" / "step-00000003" / "manifest.json").exists(), proc, timeout=240)
    proc.kill()
    proc.wait()
    assert max(_losses(run)) < 6, "the run finished before it could be killed"
    run_train(BASE, cache, run, *recipe, timeout=240)
    assert _losses(run) == _losses(straight)
    tau = {r["step"]: r["selector/tau"] for r in read_metrics(run)}
    assert tau == {r["step"]: r["selector/tau"] for r in read_metrics(straight)}

"""The distribution losses at scale: ``dflash-train estimate`` counts the second vocabulary head (checked against
the measured peak of a real training step), the Qwen presets fit with one or the estimate names the knob, and a
whole step runs at the 27B shape on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.dist import Distributed
from train.cli import main as train_cli_main
from train.components.guards import SpikeGuard
from train.components.memory import peak_memory_bytes
from train.config import GuardsConfig, TrainConfig
from train.data.batch import Batch
from train.loop.build import LossModule, build_optimizer, build_scheduler
from train.loop.step import train_step
from train.models.distill import DistributionLoss, distill_loss
from train.models.model import DFlashConfig, DFlashDrafter
from train.models.objective import FlatBatch, sample_anchors
from train.tools.estimate import DrafterShape, Precision, StepShape, memory_estimate, with_distribution_loss

ROOT = Path(__file__).resolve().parents[1]


def _drafter(shape: DrafterShape, device: str = "cpu", checkpointing: bool = False, **extra) -> DFlashDrafter:
    V, H = shape.vocab, shape.hidden
    cfg = DFlashConfig(hidden_size=H, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                       intermediate_size=shape.intermediate, vocab_size=V, block_size=shape.block_size,
                       mask_token_id=V - 1, target_layer_ids=list(range(shape.n_features)),
                       num_target_layers=shape.n_features + 3, **extra)
    with torch.device(device):
        embed = torch.randn(V, H, dtype=torch.bfloat16)
        head = (torch.randn(V, H) * 0.05).to(torch.bfloat16)
        return DFlashDrafter(cfg, embed, head, attention="sdpa", activation_checkpointing=checkpointing)


def _batch(rows: int, length: int, docs: int, width: int, vocab: int, device: str = "cpu", seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    doc_len = length // docs
    doc_ids = (torch.arange(length) // doc_len).clamp(max=docs - 1).to(torch.int32)
    pos = torch.arange(length) - doc_ids.long() * doc_len
    features = (torch.empty(rows, length, width, dtype=torch.bfloat16, device="meta") if device == "meta"
                else torch.randn(rows, length, width, generator=g).to(torch.bfloat16))
    return Batch(features=features, input_ids=torch.randint(0, vocab - 1, (rows, length), generator=g),
                 loss_mask=(pos >= 8).expand(rows, length).clone(), doc_ids=doc_ids.expand(rows, length).clone(),
                 position_ids=pos.expand(rows, length).clone(), sample_ids=torch.arange(rows * docs), bucket=0,
                 epoch=0, index=0, n_tokens=rows * length, n_padded=0, seed=2)


SHAPE = DrafterShape(hidden=512, vocab=16384, n_features=3, layers=2, heads=8, kv_heads=2, head_dim=64,
                     intermediate=1536, block_size=8)
DATA = dict(rows=2, length=384, docs=2)
ANCHORS, CHUNK = 64, 256


def measure_step(loss: str, shape: DrafterShape = SHAPE) -> tuple[int, int, object]:
    """(measured peak bytes of a real fp32 CPU training step, counted rows, the step's result)."""
    torch.manual_seed(0)
    model = _drafter(shape).train()
    tcfg = TrainConfig(num_anchors=ANCHORS, logits_chunk_rows=CHUNK)
    opt = build_optimizer(tcfg, model)
    sched = build_scheduler(tcfg, opt, total_steps=10)
    guard = SpikeGuard(GuardsConfig(window=16, min_history=4))
    lm = LossModule(model, ANCHORS, None, CHUNK)
    width = (shape.n_features + (loss != "ce")) * shape.hidden  # + the teacher's final state
    batch = _batch(DATA["rows"], DATA["length"], DATA["docs"], width, shape.vocab)
    if loss != "ce":
        lm.distribution = DistributionLoss(loss)
    step_args = (lm, opt, sched, guard, tcfg, Distributed())
    train_step(1, [batch], *step_args)
    dynamic, res = peak_memory_bytes(lambda: train_step(2, [batch], *step_args))
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    static = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), *state, batch.features,
                                                         batch.input_ids, batch.loss_mask, batch.doc_ids,
                                                         batch.position_ids])
    return static + dynamic, res.metrics["n_blocks"] * (shape.block_size - 1), res


@pytest.mark.parametrize("loss", ["lk_lambda", "kl"])
def test_estimate_counts_the_second_vocabulary_head(loss):
    measured, rows, res = measure_step(loss)
    flat_blocks = res.metrics["n_blocks"]
    step = StepShape(DATA["rows"] * DATA["length"], flat_blocks, rows, DATA["length"] / DATA["docs"] / 2,
                     rows=DATA["rows"])
    precision = Precision(compute_bytes=4, head_bytes=2, autocast=False)
    ce_est = memory_estimate(SHAPE, step, precision=precision, attention="sdpa", chunk_rows=CHUNK)
    est = with_distribution_loss(ce_est, SHAPE, step, precision=precision, chunk_rows=CHUNK)
    assert est.loss_head > ce_est.loss_head + 3 * CHUNK * SHAPE.vocab * 4  # three more fp32 [chunk, V] buffers
    assert est.batch == ce_est.batch + step.context_tokens * SHAPE.hidden * 2
    ratio = est.device_peak / measured
    assert 0.8 <= ratio <= 1.2, (est.as_dict(), measured)


def _estimate(capsys, *args: str) -> dict:
    assert train_cli_main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset,gib", [("qwen3-8b", 80), ("qwen3.6-27b", 96)])
def test_presets_fit_with_a_distribution_loss_or_the_estimate_names_the_knob(capsys, preset, gib):
    cfg = str(ROOT / "configs" / f"{preset}.toml")
    ce = _estimate(capsys, cfg, "--gpu-memory", str(gib))
    lk = _estimate(capsys, cfg, "--gpu-memory", str(gib), "--set", "train.loss=lk_lambda")
    assert lk["fits"] and lk["peak_bytes"] >= ce["peak_bytes"]
    assert lk["breakdown_at_peak"]["loss_head"] > 2 * ce["breakdown_at_peak"]["loss_head"]
    assert any("train.logits_chunk_rows" in n for n in lk["notes"])
    # a GPU too small for it (10% below its estimated peak): the text report says which knobs to lower
    small = f"{0.9 * lk['peak_bytes'] / 2**30:.1f}"
    assert train_cli_main(["estimate", cfg, "--gpu-memory", small, "--set", "train.loss=lk_lambda"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "train.logits_chunk_rows" in out


@pytest.mark.parametrize("preset", ["qwen3.6-27b"])
def test_a_distribution_loss_step_at_the_27b_shape_on_the_meta_device(preset):
    cfg = load_config(ROOT / "configs" / f"{preset}.toml")
    t, m = cfg.teacher, cfg.model
    dcfg = DFlashConfig(hidden_size=t.hidden_size, num_hidden_layers=m.num_hidden_layers,
                        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                        head_dim=m.head_dim, intermediate_size=m.intermediate_size, vocab_size=t.vocab_size,
                        block_size=m.block_size, mask_token_id=m.mask_token_id,
                        target_layer_ids=list(cfg.cache.target_layer_ids), num_target_layers=t.num_layers,
                        layer_types=m.layer_types, sliding_window=m.sliding_window)
    with torch.device("meta"):
        head = torch.empty(t.vocab_size, t.hidden_size, dtype=torch.bfloat16)
        model = DFlashDrafter(dcfg, head, head, attention="sdpa", activation_checkpointing=True).train()
    width = (len(dcfg.target_layer_ids) + 1) * t.hidden_size  # the layers and the final state
    batch = _batch(rows=8, length=2048, docs=1, width=width, vocab=t.vocab_size, device="meta")
    flat = FlatBatch.of(batch)
    n = sample_anchors(flat.eligible, flat.docs, cfg.train.num_anchors, torch.Generator().manual_seed(2)).numel()
    out = distill_loss(model, batch, DistributionLoss("lk_lambda", 0.5), num_anchors=cfg.train.num_anchors,
                       chunk_rows=cfg.train.logits_chunk_rows)
    assert out.loss.is_meta and n == 8 * cfg.train.num_anchors
    out.loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape for p in params)
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
    opt = build_optimizer(cfg.train, model)
    opt.step()
    assert norm.is_meta and all(opt.state[p]["exp_avg"].shape == p.shape for p in params)


def test_bench_distill_runs_at_a_tiny_shape(monkeypatch, tmp_path):
    import importlib.util
    import sys

    out = tmp_path / "d.json"
    monkeypatch.setattr(sys, "argv", ["bench_distill.py", "--hidden", "64", "--vocab", "500", "--doc-len", "32",
                                      "--anchors", "8", "--chunk", "64", "--rounds", "1", "--cache-hidden", "64",
                                      "--cache-samples", "4", "--out", str(out)])
    spec = importlib.util.spec_from_file_location("_bench_distill", ROOT / "bench" / "bench_distill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 0
    r = json.loads(out.read_text())
    assert r["step"]["peak_ratio"] > 1.0 and len(r["step"]["cpu_s"]["lk_lambda"]) == 4
    for codec, row in r["cache"]["bytes_per_token"].items():  # one slot more of four: about 4/3 the bytes
        assert 1.25 < row["ratio"] < 1.42, codec

"""``dflash-train estimate`` for DFlash2 drafters: the 27B DFlash2 preset fits a 96 GB GPU, its added terms count the
real modules, the estimate matches a measured DFlash2 step, and a whole step runs at the preset's shape on the meta
device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_estimate import ROOT, _batch, _estimate, _nbytes

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.dist import Distributed
from train.components.guards import SpikeGuard
from train.components.memory import peak_memory_bytes
from train.config import GuardsConfig, ModelConfig, TrainConfig
from train.data.batch import Batch
from train.loop.build import LossModule, build_optimizer, build_scheduler, build_selector_loss
from train.loop.step import train_step
from train.models.dflash2 import DFlash2Drafter, SelectorLoss, dflash2_loss
from train.models.model import DFlashConfig, DFlashDrafter
from train.models.objective import FlatBatch, sample_anchors
from train.tools.estimate import (
    DrafterShape,
    Precision,
    StepShape,
    dflash2_params,
    memory_estimate,
    with_dflash2_terms,
)

PRESET = ROOT / "configs" / "qwen3.6-27b-dflash2.toml"


def _config(cfg) -> DFlashConfig:
    t, m = cfg.teacher, cfg.model
    return DFlashConfig(hidden_size=t.hidden_size, num_hidden_layers=m.num_hidden_layers,
                        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                        head_dim=m.head_dim, intermediate_size=m.intermediate_size, vocab_size=t.vocab_size,
                        block_size=m.block_size, mask_token_id=m.mask_token_id,
                        target_layer_ids=list(cfg.cache.target_layer_ids), num_target_layers=t.num_layers,
                        layer_types=m.layer_types, sliding_window=m.sliding_window, arch=m.arch,
                        conv_kernel_size=m.conv_kernel_size, conv_group_size=m.conv_group_size,
                        selector_top_k=m.selector_top_k, selector_rank=m.selector_rank)


def test_the_preset_is_the_published_dflash2_shape():
    m = load_config(PRESET).model
    assert (m.arch, m.block_size, m.sliding_window, m.sliding_within_block) == ("dflash2", 8, 2048, "bidirectional")
    assert m.layer_types == ["sliding_attention"] * 5
    assert (m.selector_top_k, m.selector_rank, m.conv_kernel_size, m.conv_group_size) == (256, 16, 2, 16)


def test_dflash2_preset_fits_96gb_and_costs_more_than_dflash(capsys):
    out = _estimate(capsys, str(PRESET), "--gpu-memory", "96")
    assert out["fits"] and out["peak_bytes"] <= 96 * 2**30
    dflash = _estimate(capsys, str(ROOT / "configs" / "qwen3.6-27b.toml"), "--gpu-memory", "96")
    assert out["peak_bytes"] > dflash["peak_bytes"]
    plain = _estimate(capsys, str(PRESET), "--gpu-memory", "96", "--set", "model.activation_checkpointing=false")
    assert not plain["fits"]


def test_dflash2_params_count_the_real_modules():
    cfg = load_config(PRESET)
    dcfg = _config(cfg)
    with torch.device("meta"):
        head = torch.empty(dcfg.vocab_size, dcfg.hidden_size)
        plain = sum(p.numel() for p in DFlashDrafter(dataclasses.replace(dcfg, arch="dflash"), head, head).parameters())
        model = DFlash2Drafter(dcfg, head, head)
    two_d = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and ("conv" in n or "selector" in n))
    total = sum(p.numel() for p in model.parameters())
    shape = DrafterShape.from_config(cfg.model, dcfg.hidden_size, dcfg.vocab_size, len(dcfg.target_layer_ids))
    assert dflash2_params(shape, cfg.model) == (two_d, total - plain - two_d)


def test_estimate_matches_the_measured_peak_of_a_dflash2_step():
    shape = DrafterShape(hidden=512, vocab=16384, n_features=3, layers=2, heads=8, kv_heads=2, head_dim=64,
                         intermediate=1536, block_size=8)
    model_cfg = ModelConfig(arch="dflash2", num_hidden_layers=2, block_size=8, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, intermediate_size=1536, selector_top_k=256,
                            conv_group_size=16)
    rows, length, docs, num_anchors, chunk = 2, 384, 2, 64, 256
    cfg = DFlashConfig(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       intermediate_size=1536, vocab_size=16384, block_size=8, mask_token_id=16383,
                       target_layer_ids=[1, 2, 3], num_target_layers=6, arch="dflash2", selector_top_k=256)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    head = (torch.randn(16384, 512, generator=g).to(torch.bfloat16),) * 2
    model = DFlash2Drafter(cfg, *head, attention="sdpa").train()
    tcfg = TrainConfig(num_anchors=num_anchors, logits_chunk_rows=chunk)
    opt = build_optimizer(tcfg, model)
    sched = build_scheduler(tcfg, opt, total_steps=10)
    lm = LossModule(model, num_anchors, None, chunk)
    lm.selector = build_selector_loss(tcfg, model)
    nb = _batch(rows, length, docs, 3 * 512, 16384)
    batch = Batch(features=nb.features, input_ids=nb.input_ids, loss_mask=nb.loss_mask, doc_ids=nb.doc_ids,
                  position_ids=nb.position_ids, sample_ids=torch.arange(rows * docs), bucket=0, epoch=0, index=0,
                  n_tokens=rows * length, n_padded=0, seed=2)
    step_args = (lm, opt, sched, SpikeGuard(GuardsConfig(window=16, min_history=4)), tcfg, Distributed())
    train_step(1, [batch], *step_args)
    dynamic, res = peak_memory_bytes(lambda: train_step(2, [batch], *step_args))
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    measured = dynamic + _nbytes([*model.parameters(), *model.buffers(), *state, batch.features, batch.input_ids,
                                  batch.loss_mask, batch.doc_ids, batch.position_ids])
    flat = FlatBatch.of(batch)
    blocks = sample_anchors(flat.eligible, flat.docs, num_anchors, torch.Generator().manual_seed(2)).numel()
    step = StepShape(rows * length, blocks, res.metrics["n_blocks"] * 7, length / docs / 2, rows=rows)
    precision = Precision(compute_bytes=4, head_bytes=2, autocast=False)
    plain = memory_estimate(shape, step, precision=precision, attention="sdpa", chunk_rows=chunk)
    predicted = with_dflash2_terms(plain, shape, step, model_cfg, precision=precision, checkpointing=False,
                                   optimizer="adamw", chunk_rows=chunk)
    assert 0.8 <= predicted.device_peak / measured <= 1.2, (predicted.as_dict(), measured)
    assert predicted.device_peak > plain.device_peak


def test_one_dflash2_training_step_at_the_presets_shape_on_the_meta_device():
    cfg = load_config(PRESET)
    dcfg = _config(cfg)
    with torch.device("meta"):
        head = torch.empty(dcfg.vocab_size, dcfg.hidden_size, dtype=torch.bfloat16)
        model = DFlash2Drafter(dcfg, head, head, attention="sdpa", activation_checkpointing=True).train()
    # the worst step the plan allows: 8 documents of 2048 tokens, 512 anchors each (32768 blocks of 8 rows here)
    batch = _batch(rows=8, length=2048, docs=1, width=len(dcfg.target_layer_ids) * dcfg.hidden_size,
                   vocab=dcfg.vocab_size, device="meta")
    t = cfg.train
    out = dflash2_loss(model, batch, num_anchors=t.num_anchors, chunk_rows=t.logits_chunk_rows,
                       selector=SelectorLoss(t.selector_alpha, t.selector_gold_outside, t.selector_detach_backbone))
    assert out.loss.is_meta
    out.loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape for p in params)
    assert model.candidate_selector.successor_codebook.weight.grad is not None
    opt = build_optimizer(t, model)
    torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
    opt.step()
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in params)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_the_logit_transform_alone_trains_through_the_dflash2_loss(arch):
    """A DFlash drafter with output_multiplier / final_logit_softcapping gets the transformed unary loss only."""
    tcfg = TrainConfig()
    cfg = DFlashConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, vocab_size=96, block_size=4, mask_token_id=95, target_layer_ids=[1],
                       num_target_layers=4, arch=arch, final_logit_softcapping=5.0)
    head = torch.randn(96, 64)
    model = (DFlash2Drafter if arch == "dflash2" else DFlashDrafter)(cfg, head, head)
    assert build_selector_loss(tcfg, model) == SelectorLoss()
    plain = DFlashDrafter(dataclasses.replace(cfg, arch="dflash", final_logit_softcapping=None), head, head)
    assert build_selector_loss(tcfg, plain) is None

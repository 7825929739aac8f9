"""The drafter computes in the dtype the config asks for, also under CUDA autocast's rule that runs norms in
fp32 (emulated on the CPU): the residual stream, q/k/v and the loss head's operands stay bf16 and the lm_head
is never copied to fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_cache.runtime.dist import Distributed
from train.components.guards import SpikeGuard
from train.config import GuardsConfig, TrainConfig
from train.data.batch import Batch
from train.loop.build import LossModule, build_optimizer, build_scheduler
from train.loop.step import train_step
from train.models.dtypes import DtypeProbe, cuda_autocast_rules_on_cpu
from train.models.model import DFlashConfig, DFlashDrafter, RMSNorm

PLACES = ("attention_k", "attention_q", "attention_v", "context", "final_norm", "loss_head_hidden",
          "loss_head_weight", "residual")


def _model(checkpointing: bool = False) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=512, block_size=8, mask_token_id=511,
                       target_layer_ids=[0, 1, 2], num_target_layers=6)
    head = (torch.randn(512, 64) * 0.05).to(torch.bfloat16)
    return DFlashDrafter(cfg, head, head, attention="sdpa", activation_checkpointing=checkpointing).train()


def _batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    T = 128
    doc = (torch.arange(T) // 64).to(torch.int32)
    pos = torch.arange(T) - doc.long() * 64
    return Batch(features=torch.randn(1, T, 3 * 64, generator=g).to(torch.bfloat16),
                 input_ids=torch.randint(0, 511, (1, T), generator=g), loss_mask=(pos >= 4).unsqueeze(0),
                 doc_ids=doc.unsqueeze(0), position_ids=pos.unsqueeze(0), sample_ids=torch.arange(2), bucket=0,
                 epoch=0, index=0, n_tokens=T, n_padded=0, seed=3)


def _step_dtypes(precision: str, checkpointing: bool = False) -> dict[str, list[str]]:
    """One real training step (train_step, autocast as the config says) under CUDA's autocast rule."""
    model = _model(checkpointing)
    tcfg = TrainConfig(num_anchors=8, logits_chunk_rows=16, precision=precision)
    opt = build_optimizer(tcfg, model)
    args = (LossModule(model, 8, None, 16), opt, build_scheduler(tcfg, opt, total_steps=4),
            SpikeGuard(GuardsConfig(window=16, min_history=4)), tcfg, Distributed())
    with DtypeProbe(model) as probe, cuda_autocast_rules_on_cpu():
        res = train_step(1, [_batch()], *args)
    assert res.metrics["n_blocks"] > 0 and torch.isfinite(torch.tensor(res.loss))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    return probe.as_dict()


def test_the_emulated_cuda_rule_promotes_norms_and_goes_away_after():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.rms_norm(x, (8,)).dtype == torch.bfloat16  # CPU autocast's own rule
        with cuda_autocast_rules_on_cpu():
            assert F.rms_norm(x, (8,)).dtype == torch.float32  # CUDA's: fp32 outputs
            assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert F.rms_norm(x, (8,)).dtype == torch.bfloat16


def test_bf16_step_keeps_bf16_everywhere_under_cuda_autocast_rule():
    seen = _step_dtypes("bf16")
    assert set(PLACES) <= set(seen)
    assert all(seen[p] == ["bfloat16"] for p in PLACES), seen
    assert seen["loss_head_weight_copied"] == ["False"]  # the bf16 lm_head is used as stored


def test_bf16_step_with_activation_checkpointing_keeps_bf16():
    seen = _step_dtypes("bf16", checkpointing=True)
    assert all(seen[p] == ["bfloat16"] for p in PLACES), seen


def test_fp32_config_computes_in_fp32():
    seen = _step_dtypes("fp32")
    assert all(seen[p] == ["float32"] for p in PLACES), seen
    assert seen["loss_head_weight_copied"] == ["True"]  # the bf16 head is cast for fp32 compute, by request


def test_a_plain_rms_norm_would_be_promoted_there(monkeypatch):
    """The emulation is what makes the test above meaningful: with a norm that leaves autocast on, CUDA's rule
    turns the residual stream, q/k and the loss head's input into fp32."""
    monkeypatch.setattr(RMSNorm, "forward",
                        lambda self, x: F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps))
    seen = _step_dtypes("bf16")
    assert seen["residual"] == ["float32"] and seen["attention_q"] == ["float32"] and seen["final_norm"] == ["float32"]
    # the loss head still computes in bf16 and never copies the lm_head to fp32
    assert seen["loss_head_hidden"] == ["bfloat16"] and seen["loss_head_weight_copied"] == ["False"]


def test_rms_norm_matches_torch_and_its_gradient():
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(32, 1e-6)
        norm.weight.data = torch.randn(32)
        x = torch.randn(3, 5, 32).to(dtype).requires_grad_()
        y = norm(x)
        assert y.dtype == dtype and torch.equal(y, F.rms_norm(x, (32,), norm.weight.to(dtype), 1e-6))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    from train.models.model import _RMSNormFn

    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, 1e-6), (x, w), eps=1e-3, atol=1e-2)

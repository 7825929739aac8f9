"""train_step on a tiny drafter and hand-made batches: guards leave state bitwise unchanged, schedule."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.schema import GuardsConfig, TrainConfig
from train.batch import Batch
from train.build import LossModule, build_loss_module, build_optimizer, build_scheduler, lr_lambda
from train.guards import SpikeGuard
from train.model import DFlashConfig, DFlashDrafter
from train.step import FaultPlan, train_step

H, V, NL = 32, 64, 2


def _drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, intermediate_size=64, vocab_size=V, block_size=4, mask_token_id=V - 1,
                       target_layer_ids=[0, 1], num_target_layers=4)
    return DFlashDrafter(cfg, torch.randn(V, H) * 0.1, torch.randn(V, H) * 0.1)


def _batch(index: int, rows: int = 2, T: int = 24) -> Batch:
    g = torch.Generator().manual_seed(index)
    return Batch(
        features=torch.randn(rows, T, NL * H, generator=g).to(torch.bfloat16),
        input_ids=torch.randint(0, V - 1, (rows, T), generator=g),
        loss_mask=torch.ones(rows, T, dtype=torch.bool),
        doc_ids=torch.zeros(rows, T, dtype=torch.int32),
        position_ids=torch.arange(T).expand(rows, T).clone(),
        sample_ids=torch.arange(rows) + 100 * index,
        bucket=index % 2, epoch=0, index=index, n_tokens=rows * T, n_padded=0, seed=index,
    )


def _setup(**train_kw):
    model = _drafter()
    tcfg = TrainConfig(num_anchors=4, warmup_ratio=0.25, **train_kw)
    opt = build_optimizer(tcfg, model)
    sched = build_scheduler(tcfg, opt, total_steps=8)
    guard = SpikeGuard(GuardsConfig(window=16, min_history=4))
    return model, tcfg, opt, sched, guard, LossModule(model, tcfg.num_anchors, None)


def _snapshot(model, opt):
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    moments = {id(p): {k: t.clone() for k, t in s.items()} for p, s in opt.state.items()}
    return params, moments


def _bitwise_same(a, b) -> bool:
    pa, ma = a
    pb, mb = b
    return all(torch.equal(pa[k], pb[k]) for k in pa) and ma.keys() == mb.keys() and all(
        torch.equal(ma[i][k], mb[i][k]) for i in ma for k in ma[i])


def test_normal_steps_update_and_follow_schedule():
    model, tcfg, opt, sched, guard, lm = _setup()
    before = _snapshot(model, opt)
    lrs = []
    for step in range(1, 4):
        res = train_step(step, [_batch(step)], lm, opt, sched, guard, tcfg, Distributed())
        assert not res.verdict.skip and math.isfinite(res.loss) and res.grad_norm > 0
        assert 1.0 <= res.metrics["acceptance_length"] <= 4.0
        assert len(res.metrics["accuracy_per_position"]) == 3
        lrs.append(res.lr)
    assert not _bitwise_same(before, _snapshot(model, opt))
    warmup = math.ceil(0.25 * 8)
    assert lrs == pytest.approx([tcfg.lr * lr_lambda(s, 8, warmup, 0.0) for s in range(3)])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_injected_fault_is_skipped_bitwise(kind):
    model, tcfg, opt, sched, guard, lm = _setup()
    faults = FaultPlan(nan_steps=frozenset({6} if kind == "nan" else ()),
                       spike_steps=frozenset({6} if kind == "spike" else ()))
    for step in range(1, 6):
        assert not train_step(step, [_batch(step)], lm, opt, sched, guard, tcfg, Distributed(), faults).verdict.skip
    before = _snapshot(model, opt)
    sched_before = sched.state_dict()
    window_before = guard.state_dict()
    res = train_step(6, [_batch(6)], lm, opt, sched, guard, tcfg, Distributed(), faults)
    assert res.verdict.skip
    assert res.verdict.reason == ("nonfinite_loss" if kind == "nan" else "grad_norm_spike")
    assert _bitwise_same(before, _snapshot(model, opt))
    assert sched.state_dict() == sched_before
    assert guard.total_skips == 1 and list(guard.grad_norms) == window_before["grad_norms"]
    # the next (clean) step proceeds with the lr the skipped step would have used
    res7 = train_step(7, [_batch(7)], lm, opt, sched, guard, tcfg, Distributed(), faults)
    assert not res7.verdict.skip and res7.lr == res.lr


def test_grad_accum_equals_mean_of_micro_batches():
    model, tcfg, opt, sched, guard, lm = _setup(grad_accum=2)
    res = train_step(1, [_batch(1), _batch(2)], lm, opt, sched, guard, tcfg, Distributed())
    ref = _drafter()
    lref = LossModule(ref, 4, None)
    losses = [lref(_batch(i))[0].item() for i in (1, 2)]
    assert res.loss == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert set(res.metrics["bucket_loss"]) == {0, 1}


def test_the_trainers_loss_module_uses_train_logits_chunk_rows(monkeypatch):
    # the knob `dflash-train estimate` names to lower the loss head's memory must reach the loss head
    import train.objective as objective

    seen: list[int] = []
    real = objective.chunked_cross_entropy

    def spy(hidden, weight, targets, row_weights, chunk):
        seen.append(chunk)
        return real(hidden, weight, targets, row_weights, chunk)

    monkeypatch.setattr(objective, "chunked_cross_entropy", spy)
    model = _drafter()
    tcfg = TrainConfig(num_anchors=4, logits_chunk_rows=3)
    loss, _ = build_loss_module(tcfg, model, Distributed())(_batch(1))
    loss.backward()
    assert seen == [3]

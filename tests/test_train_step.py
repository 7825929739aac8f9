"""train_step on a tiny drafter and hand-made batches: guards leave state bitwise unchanged, schedule,
for both optimizer choices (AdamW; Muon for the matrices + AdamW for the rest)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dflash_cache.runtime.dist import Distributed
from train.components.guards import SpikeGuard
from train.components.optim import CombinedOptimizer
from train.config import GuardsConfig, TrainConfig
from train.data.batch import Batch
from train.loop.build import LossModule, build_loss_module, build_optimizer, build_scheduler, lr_lambda
from train.loop.step import FaultPlan, train_step
from train.models.model import DFlashConfig, DFlashDrafter
from train.tools.estimate import DrafterShape, optimizer_state_bytes

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
    return model, tcfg, opt, sched, guard, LossModule(model, tcfg.num_anchors)


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


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_injected_fault_is_skipped_bitwise(kind, optimizer):
    model, tcfg, opt, sched, guard, lm = _setup(optimizer=optimizer, muon_lr=2e-3)
    faults = FaultPlan(nan_steps=frozenset({6} if kind == "nan" else ()),
                       spike_steps=frozenset({6} if kind == "spike" else ()))
    for step in range(1, 6):
        assert not train_step(step, [_batch(step)], lm, opt, sched, guard, tcfg, Distributed(), faults).verdict.skip
    before = _snapshot(model, opt)
    moments = {name for s in before[1].values() for name in s}
    assert moments == ({"step", "exp_avg", "exp_avg_sq", "momentum_buffer"} if optimizer == "muon"
                       else {"step", "exp_avg", "exp_avg_sq"})
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
    lref = LossModule(ref, 4)
    losses = [lref(_batch(i))[0].item() for i in (1, 2)]
    assert res.loss == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert set(res.metrics["bucket_loss"]) == {0, 1}


def test_muon_takes_the_weight_matrices_and_the_schedule_drives_both_parts():
    model, tcfg, opt, sched, guard, lm = _setup(optimizer="muon", muon_lr=2e-3, lr=5e-4)
    assert isinstance(opt, CombinedOptimizer) and list(opt.parts) == ["muon", "adamw"]
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in opt.parts["muon"].param_groups for p in g["params"])
    adamw = sorted(names[id(p)] for g in opt.parts["adamw"].param_groups for p in g["params"])
    assert muon == sorted(n for n, p in model.named_parameters() if p.ndim == 2)
    assert {n.rsplit(".", 2)[-2] for n in muon} == {"fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                   "up_proj", "down_proj"}
    assert adamw == sorted(n for n, p in model.named_parameters() if p.ndim == 1)  # the norm weights
    warmup = math.ceil(0.25 * 8)
    for step in range(1, 4):
        res = train_step(step, [_batch(step)], lm, opt, sched, guard, tcfg, Distributed())
        assert not res.verdict.skip
        scale = lr_lambda(step, 8, warmup, 0.0)  # the multiplier for the next update
        assert opt.parts["muon"].param_groups[0]["lr"] == pytest.approx(2e-3 * scale)
        assert opt.parts["adamw"].param_groups[0]["lr"] == pytest.approx(5e-4 * scale)
        assert res.lr == pytest.approx(2e-3 * lr_lambda(step - 1, 8, warmup, 0.0))  # the logged lr: Muon's


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_is_what_the_memory_estimate_counts(optimizer):
    # Muon: one fp32 momentum buffer per matrix element, AdamW two moments (the per-tensor step counts aside)
    model, tcfg, opt, sched, guard, lm = _setup(optimizer=optimizer)
    train_step(1, [_batch(1)], lm, opt, sched, guard, tcfg, Distributed())
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    shape = DrafterShape(hidden=H, vocab=V, n_features=NL, layers=1, heads=2, kv_heads=1, head_dim=16,
                         intermediate=64, block_size=4)
    assert held == optimizer_state_bytes(shape, optimizer)
    assert sum(p.numel() for p in model.parameters()) == sum(shape.param_counts())


def test_muon_state_round_trips_bitwise():
    model, tcfg, opt, sched, guard, lm = _setup(optimizer="muon", muon_lr=2e-3)
    for step in range(1, 3):
        train_step(step, [_batch(step)], lm, opt, sched, guard, tcfg, Distributed())
    twin, _, opt2, sched2, guard2, lm2 = _setup(optimizer="muon", muon_lr=2e-3)
    twin.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint: no tensor shared
    sched2.load_state_dict(sched.state_dict())
    guard2.load_state_dict(guard.state_dict())
    for step in range(3, 5):
        a = train_step(step, [_batch(step)], lm, opt, sched, guard, tcfg, Distributed())
        b = train_step(step, [_batch(step)], lm2, opt2, sched2, guard2, tcfg, Distributed())
        assert a.loss == b.loss and a.lr == b.lr and a.grad_norm == b.grad_norm
    assert opt2.param_groups[1] is opt2.parts["adamw"].param_groups[0]  # the scheduler still drives the parts
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="parts"):
        opt2.load_state_dict({"adamw": opt.parts["adamw"].state_dict()})


def test_the_trainers_loss_module_uses_train_logits_chunk_rows(monkeypatch):
    # the knob `dflash-train estimate` names to lower the loss head's memory must reach the loss head
    import train.models.objective as objective

    seen: list[int] = []
    real = objective.chunked_cross_entropy

    def spy(hidden, weight, targets, chunk):
        seen.append(chunk)
        return real(hidden, weight, targets, chunk)

    monkeypatch.setattr(objective, "chunked_cross_entropy", spy)
    model = _drafter()
    tcfg = TrainConfig(num_anchors=4, logits_chunk_rows=3)
    loss, _ = build_loss_module(tcfg, model, Distributed())(_batch(1))
    loss.backward()
    assert seen == [3]

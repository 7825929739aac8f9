"""What a checkpoint saves comes back, piece by piece, through ``train.components.state.resume``; nothing is saved that
a resume does not use; a save killed before its rename leaves no ``step-N`` directory.

``tests/mutation_check.py`` breaks each of these in a copy of the repository and checks these tests fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch
from fixtures.trainer import CONFIG, ROOT, small_cache

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.dist import Distributed
from dflash_cache.spec import CacheSpec
from train.components.checkpoint import Checkpointer, find_latest, list_checkpoints, read_checkpoint
from train.components.guards import SpikeGuard, Verdict
from train.components.state import resume, training_components, training_state
from train.loop.build import build_loader, build_model, build_optimizer, build_scheduler, open_training_cache

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16"]
DEADLINE_S = 120.0


def _components(cfg, cache, d):
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cache, d.device)
    optimizer = build_optimizer(cfg.train, model)
    loader = build_loader(cfg.loader, cache, d, seed=cfg.train.seed, epochs=cfg.train.epochs,
                          num_anchors=cfg.train.num_anchors, block_size=cfg.model.block_size)
    scheduler = build_scheduler(cfg.train, optimizer, total_steps=50)
    return model, optimizer, scheduler, loader, SpikeGuard(cfg.guards)


def _same(a, b) -> bool:
    """Nested equality with tensors compared exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_resume_restores_every_piece_of_saved_state(tmp_path):
    cache_url = small_cache(str(tmp_path / "cache"))
    cfg = load_config(CONFIG, BASE)
    cache = open_training_cache(cache_url, cfg.loader)
    d = Distributed.start(use_cuda=False)
    loaders = []
    try:
        model, optimizer, scheduler, loader, guard = _components(cfg, cache, d)
        loaders.append(loader)
        batches = iter(loader)
        for _ in range(3):  # move every piece away from its initial state
            next(batches)
            loss = sum(p.float().pow(2).sum() for p in model.parameters() if p.requires_grad)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        for i in range(cfg.guards.min_history + 4):  # a steady window: loss ~2, grad norm ~1
            guard.update(Verdict(False), 2.0 + 0.01 * (i % 5), 1.0 + 0.01 * (i % 3))
        guard.update(Verdict(True, "loss_spike"), 50.0, 1.0)
        step = 3
        state = training_state(step, training_components(optimizer, scheduler, loader, guard, d), cache, d)
        ckpt = Checkpointer(tmp_path / "run", cfg.checkpoint, cache_fingerprint=cache.spec.fingerprint)
        ckpt.save(step, model.state_dict(), state)
        ckpt.close()

        fresh = _components(cfg, cache, d)
        model2, optimizer2, scheduler2, loader2, guard2 = fresh
        loaders.append(loader2)
        spike = (2.0, 40.0)  # loss 2 (normal), grad norm 40x the window's median
        unjudged = SpikeGuard(cfg.guards).check(*spike)  # what a guard without the window says
        ckpt2 = Checkpointer(tmp_path / "run", cfg.checkpoint, cache_fingerprint=cache.spec.fingerprint)
        got_step = resume(cfg.checkpoint, ckpt2, cache, model2,
                          training_components(optimizer2, scheduler2, loader2, guard2, d), d)
        saved = read_checkpoint(find_latest(tmp_path / "run")).state

        checks = {  # every piece the checkpoint saves, and how the resumed run shows it was restored
            "step": lambda: got_step == step,
            "world_size": lambda: saved["world_size"] == d.world_size,  # checked by resume, not restored
            "optimizer": lambda: _same(optimizer2.state_dict(), optimizer.state_dict()),
            "scheduler": lambda: _same(scheduler2.state_dict(), scheduler.state_dict()),
            "loader": lambda: _same(loader2.state_dict(), loader.state_dict()),
            # the first step after the resume is judged by the restored window, as it would have been
            "guard": lambda: (_same(guard2.state_dict(), guard.state_dict())
                              and guard2.check(*spike) == guard.check(*spike) != unjudged),
            # used to name the differing fields when a resume is refused on another cache
            "cache_spec": lambda: CacheSpec.from_dict(saved["cache_spec"]).diff(cache.spec) == [],
        }
        assert set(saved) == set(checks), f"saved but not checked: {set(saved) - set(checks)}; " \
                                          f"checked but not saved: {set(checks) - set(saved)}"
        failed = [name for name, ok in checks.items() if not ok()]
        assert failed == [], f"not restored: {failed}"
        for name, p in model.state_dict().items():  # the weights (model.safetensors)
            assert torch.equal(model2.state_dict()[name], p), name
        assert next(iter(loader2)).seed == next(batches).seed  # the next batch is the one the first run reads next
    finally:
        for ld in loaders:
            ld.close()
        d.close()


_SAVER = textwrap.dedent("""
    import os, sys, torch
    from train.config import CheckpointConfig
    from train.components.checkpoint import WRITE_DELAY_ENV, Checkpointer
    ck = Checkpointer(sys.argv[1], CheckpointConfig(keep_last=3))
    ck.save(1, {"w": torch.ones(4)}, {"step": 1})
    ck.wait()
    os.environ[WRITE_DELAY_ENV] = "600"  # the next save stops after its first file, long enough to be killed
    ck.save(2, {"w": torch.full((4,), 2.0)}, {"step": 2})
    ck.wait()
""")


def test_a_checkpoint_killed_before_its_rename_leaves_no_step_directory(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(run)], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                            text=True)
    root = run / "checkpoints"
    started = [root / "step-00000002.tmp" / "model.safetensors", root / "step-00000002" / "model.safetensors"]
    try:
        t0 = time.monotonic()
        while not any(p.exists() for p in started):  # the second save has written a file: it is mid-save
            assert proc.poll() is None, f"the saver exited early: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() - t0 < DEADLINE_S, "the second save never started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert [s for s, _ in list_checkpoints(run)] == [1]
    assert not (root / "step-00000002").exists()
    assert find_latest(run) == root / "step-00000001"
    Checkpointer(run, load_config(CONFIG, BASE).checkpoint)  # the next trainer clears the torn save away
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]


"""``dflash-train`` through the real command on a small synthetic cache (CPU).

Covers: exact artifacts, resume exactness after SIGKILL (bitwise per-step losses; also with Muon + D-PACE),
SIGKILL at random moments during saves, injected NaN / spike (bitwise unchanged state, AdamW moments and
Muon momentum), too many skips (distinct exit code), SIGTERM, cache fingerprint mismatch, a resume under
another optimizer refused, TensorBoard continuity, 2-process DDP.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from fixtures.trainer import ROOT, run_train, small_cache, train_cmd, train_env

from train.components.checkpoint import find_latest, list_checkpoints, read_checkpoint, validate_checkpoint
from train.components.metrics import read_metrics
from train.models.model import read_weights_config

# small batches keep each step (and so each subprocess run) cheap on 2 shared CPU cores
BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return small_cache(str(tmp_path_factory.mktemp("cache") / "cache"))


_cmd = partial(train_cmd, BASE)
_env = train_env
_run = partial(run_train, BASE, timeout=600)


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run)}


def _tb_steps(run: Path, tag: str = "train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _wait_for(pred, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, f"training exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
        assert time.time() - t0 < timeout, "timed out waiting for the training subprocess"
        time.sleep(0.01)


def test_full_run_artifacts_then_sigkill_resume_is_bitwise_exact(cache, tmp_path):
    straight = tmp_path / "straight"
    _run(cache, straight, "train.max_steps=16", "checkpoint.every_steps=4")
    ref = _losses(straight)
    assert sorted(ref) == list(range(1, 17))
    assert sorted(p.name for p in straight.iterdir()) == ["checkpoints", "config.json", "metrics.jsonl", "tensorboard",
                                                          "trainer.lock"]
    assert json.loads((straight / "trainer.lock").read_text())["released"] is True
    assert [s for s, _ in list_checkpoints(straight)] == [12, 16]  # keep_last = 2
    latest = read_checkpoint(find_latest(straight))
    assert latest.step == 16 and latest.config["train"]["max_steps"] == 16
    assert read_weights_config(latest.path / "model.safetensors").block_size == 8  # export needs no cache
    assert latest.manifest["cache_fingerprint"] and set(latest.state) >= {
        "optimizer", "scheduler", "loader", "guard", "step"} and "rng" not in latest.state

    # same run, SIGKILLed once checkpoint 8 is committed, then resumed by rerunning the command
    run = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(cache, run, "train.max_steps=16", "checkpoint.every_steps=4"), cwd=ROOT,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (run / "checkpoints" / "step-00000008" / "manifest.json").exists(), proc)
    proc.kill()
    proc.wait()
    killed_at = max(_losses(run))
    assert killed_at < 16, "the run finished before it could be killed"
    _run(cache, run, "train.max_steps=16", "checkpoint.every_steps=4")
    resumed = _losses(run)
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 17))  # no gap, no duplicate
    assert resumed == ref  # bitwise: floats from JSON compare exactly
    assert sorted(_tb_steps(run)) == list(range(1, 17))


@pytest.mark.parametrize("optimizer,weighting", [("muon", "dpace"), ("adamw", "exp_decay")])
def test_each_recipe_resumes_bitwise_after_sigkill(cache, tmp_path, optimizer, weighting):
    recipe = (f"train.optimizer={optimizer}", "train.muon_lr=2e-3", f"train.loss_weighting={weighting}",
              "train.max_steps=8", "checkpoint.every_steps=4")
    straight = tmp_path / "straight"
    _run(cache, straight, *recipe)
    ref = _losses(straight)
    latest = read_checkpoint(find_latest(straight))
    opt_state = latest.state["optimizer"]
    if optimizer == "muon":  # both parts' state in the checkpoint
        assert sorted(opt_state) == ["adamw", "muon"]
        matrices = [k for k, v in latest.model.items() if v.ndim == 2]
        assert len(opt_state["muon"]["state"]) == len(matrices) > 0
        assert all(set(s) == {"momentum_buffer"} for s in opt_state["muon"]["state"].values())
        assert latest.state["scheduler"]["base_lrs"] == [2e-3, 3e-3]  # Muon's peak lr, AdamW's (tiny.toml)
        opt_state = opt_state["adamw"]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in opt_state["state"].values())

    run = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(cache, run, *recipe), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (run / "checkpoints" / "step-00000004" / "manifest.json").exists(), proc)
    proc.kill()
    proc.wait()
    assert max(_losses(run)) < 8, "the run finished before it could be killed"
    _run(cache, run, *recipe)
    assert _losses(run) == ref  # bitwise: optimizer state (Muon momentum, AdamW moments) and schedule restored
    # continuing under the other optimizer choice is refused, as a config change and, when config changes are
    # allowed, because the optimizer state cannot carry over
    other = "adamw" if optimizer == "muon" else "muon"
    proc = _run(cache, run, *recipe, f"train.optimizer={other}", "train.max_steps=10", expect=2)
    assert f'train.optimizer: "{optimizer}" -> "{other}"' in proc.stderr
    proc = _run(cache, run, *recipe, f"train.optimizer={other}", "train.max_steps=10",
                "checkpoint.allow_config_change=true", expect=2)
    assert "holds the state of optimizer(s) " + ("muon+adamw" if optimizer == "muon" else "adamw") in proc.stderr
    assert "cannot be carried to another train.optimizer" in proc.stderr


def test_sigkill_during_save_always_leaves_a_loadable_checkpoint(cache, tmp_path):
    run = tmp_path / "run"
    rng = random.Random(0)
    overrides = ("train.max_steps=1000", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
                 "checkpoint.allow_config_change=true")  # the first run below is shorter
    _run(cache, run, "train.max_steps=2", *overrides[1:])  # one committed checkpoint to fall back on
    kills_mid_save = 0
    for _ in range(10):
        proc = subprocess.Popen(_cmd(cache, run, *overrides), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True,
                                env=_env(DFLASH_TEST_CKPT_WRITE_DELAY_S="0.1"))
        root = run / "checkpoints"
        _wait_for(lambda root=root: root.is_dir() and any(p.suffix == ".tmp" for p in root.iterdir()), proc)
        time.sleep(rng.uniform(0.0, 0.45))  # somewhere inside (or just after) the >= 0.4 s write
        kills_mid_save += any(p.suffix == ".tmp" for p in root.iterdir())
        proc.kill()
        proc.wait()
        committed = list_checkpoints(run)
        for _, path in committed:  # anything renamed into place is complete
            validate_checkpoint(path)
        latest = read_checkpoint(find_latest(run))
        assert latest.step == committed[-1][0] >= 2
    assert kills_mid_save >= 4  # most kills land mid-save; the others between saves


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_injected_nan_and_spike_are_skipped_bitwise(cache, tmp_path, optimizer):
    run = tmp_path / "run"
    _run(cache, run, "train.max_steps=10", "checkpoint.every_steps=1", "checkpoint.keep_last=20",
         "guards.min_history=4", f"train.optimizer={optimizer}",
         DFLASH_TEST_FAULTS='{"nan_steps": [5], "spike_steps": [9]}')
    recs = {r["step"]: r for r in read_metrics(run)}
    assert sorted(recs) == list(range(1, 11))
    assert recs[5]["train/skipped"] == 1 and recs[5]["train/skip_reason"] == "nonfinite_loss"
    assert recs[5]["train/loss"] == "nan"
    assert recs[9]["train/skipped"] == 1 and recs[9]["train/skip_reason"] == "grad_norm_spike"
    assert recs[9]["train/loss"] > 1e5 and recs[9]["train/skipped_sample_ids"]
    assert [s for s, r in recs.items() if r["train/skipped"]] == [5, 9]
    assert recs[10]["train/skipped_total"] == 2
    ckpts = dict(list_checkpoints(run))
    for bad in (5, 9):
        before, after = read_checkpoint(ckpts[bad - 1]), read_checkpoint(ckpts[bad])
        for k in before.model:
            assert torch.equal(before.model[k], after.model[k]), k
        # AdamW's moments (every parameter, or the norms beside Muon) and Muon's momentum (the matrices)
        sa, sb = before.state["optimizer"], after.state["optimizer"]
        parts = [("muon", ("momentum_buffer",)), ("adamw", ("exp_avg", "exp_avg_sq", "step"))]
        if optimizer == "adamw":
            sa, sb, parts = {"adamw": sa}, {"adamw": sb}, parts[1:]
        for part, names in parts:
            assert sa[part]["state"]
            for i in sa[part]["state"]:
                for name in names:
                    assert torch.equal(sa[part]["state"][i][name], sb[part]["state"][i][name]), (part, i, name)
        assert before.state["scheduler"] == after.state["scheduler"]
        assert after.state["guard"]["grad_norms"] == before.state["guard"]["grad_norms"]
    # the step after a skip does change the weights
    a, b = read_checkpoint(ckpts[5]), read_checkpoint(ckpts[6])
    assert any(not torch.equal(a.model[k], b.model[k]) for k in a.model)


def test_consecutive_skips_stop_with_distinct_exit_code(cache, tmp_path):
    run = tmp_path / "run"
    proc = _run(cache, run, "train.max_steps=20", "checkpoint.every_steps=2", "guards.max_consecutive_skips=3",
                expect=3, DFLASH_TEST_FAULTS='{"nan_steps": [5, 6, 7]}')
    assert "3 consecutive steps were skipped" in proc.stderr
    assert "step-00000004" in proc.stderr  # where the last good checkpoint is
    assert max(_losses(run)) == 7


def test_sigterm_saves_and_rerun_resumes(cache, tmp_path):
    run = tmp_path / "run"
    overrides = ("train.max_steps=1000", "checkpoint.every_steps=500")
    proc = subprocess.Popen(_cmd(cache, run, *overrides), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(read_metrics(run)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = max(_losses(run))
    assert find_latest(run).name == f"step-{last:08d}" and "Rerun the same command" in err
    _run(cache, run, "train.max_steps=" + str(last + 2), "checkpoint.every_steps=500", "checkpoint.allow_config_change=true")
    assert [r["step"] for r in read_metrics(run)] == list(range(1, last + 3))


def test_a_second_sigterm_during_the_save_does_not_lose_the_checkpoint(cache, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(cache, run, "train.max_steps=1000", "checkpoint.every_steps=500"), cwd=ROOT,
                            env=_env(DFLASH_TEST_CKPT_WRITE_DELAY_S="0.3"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(read_metrics(run)) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    root = run / "checkpoints"
    _wait_for(lambda: root.is_dir() and any(p.suffix == ".tmp" for p in root.iterdir()), proc)  # mid-save
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "received SIGTERM again: already stopping" in err and "Traceback" not in err
    last = max(_losses(run))
    assert find_latest(run).name == f"step-{last:08d}"  # the checkpoint the first signal promised


def test_resume_on_another_cache_is_refused_unless_overridden(cache, tmp_path):
    other = small_cache(str(tmp_path / "other"), codec="bf16-lz4")
    run = tmp_path / "run"
    _run(cache, run, "train.max_steps=2", "checkpoint.every_steps=2")
    proc = _run(other, run, "train.max_steps=4", expect=2)
    assert "codec" in proc.stderr and "ignore_fingerprint_mismatch" in proc.stderr
    proc = _run(cache, run, "train.max_steps=4", "checkpoint.resume=false", expect=2)
    assert "already holds checkpoints" in proc.stderr
    _run(other, run, "train.max_steps=4", "checkpoint.ignore_fingerprint_mismatch=true",
         "checkpoint.allow_config_change=true")
    assert max(_losses(run)) == 4


def test_ddp_two_gloo_processes_match_single_process(cache, tmp_path):
    common = ("train.num_anchors=512",)  # every eligible anchor: no dependence on per-rank batch seeds
    single = tmp_path / "single"
    extend = "checkpoint.allow_config_change=true"  # the resumed part raises max_steps
    for steps in (2, 3):  # the same 2 + resumed 1 steps as the DDP run below (max_steps shapes the schedule)
        _run(cache, single, *common, "train.grad_accum=2", f"train.max_steps={steps}", "checkpoint.every_steps=2",
             extend)
    ddp = tmp_path / "ddp"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(29500 + os.getpid() % 1000)]
    # 2 steps with a checkpoint, then the same command resumed to step 3: each rank its own loader state
    for steps in (2, 3):
        args = _cmd(cache, ddp, *common, f"train.max_steps={steps}", "checkpoint.every_steps=2", extend)[1:]
        proc = subprocess.run([*torchrun, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert [len(x) for x in read_checkpoint(find_latest(ddp)).state["loader"]] == [len(
        read_checkpoint(find_latest(ddp)).state["loader"][0])] * 2
    a, b = read_metrics(single), read_metrics(ddp)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=1e-5)
        assert rb["train/grad_norm"] == pytest.approx(ra["train/grad_norm"], rel=1e-4)
    # one checkpoint, written once, with weights matching the single-process run
    wa, wb = read_checkpoint(find_latest(single)).model, read_checkpoint(find_latest(ddp)).model
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6)
    shutil.rmtree(tmp_path)


def test_periodic_heldout_eval_is_logged_and_keeps_resume_exact(cache, tmp_path):
    every = ["loader.holdout_fraction=0.2", "train.max_steps=6", "checkpoint.every_steps=3"]
    straight = tmp_path / "straight"
    _run(cache, straight, *every)
    with_eval = tmp_path / "with_eval"
    _run(cache, with_eval, *every, "eval.every_steps=2")
    records = {r["step"]: r for r in read_metrics(with_eval, kind="eval")}
    assert sorted(s for s, r in records.items() if "eval/acceptance_length" in r) == [2, 4, 6]
    assert all(records[s]["eval/n_blocks"] > 0 and records[s]["eval/acceptance_length"] >= 1.0 for s in (2, 4, 6))
    assert "eval/acceptance_length" in _tb_tags(with_eval)
    # scoring every held-out anchor draws no random numbers: the training itself is unchanged
    assert _losses(with_eval) == _losses(straight)


def _tb_tags(run: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return acc.Tags()["scalars"]

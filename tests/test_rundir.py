"""One run dir, one trainer: the lock (a second trainer refused, dead holders taken over, other hosts judged by
their heartbeat), resume refusals (changed config, invalid checkpoints), and run dirs that cannot be written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fixtures.trainer import ROOT, small_cache, train_argv

from dflash_cache.runtime.schema import PipelineConfig
from train.cli import main
from train.components.checkpoint import list_checkpoints, read_checkpoint
from train.components.metrics import read_metrics
from train.components.rundir import Holder, RunDirError, RunDirLock
from train.components.state import RESUME_RULES, resume_rule
from train.loop.build import lr_lambda

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
        "loader.tokens_per_batch=512", "train.num_anchors=16", "metrics.tensorboard=false"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return small_cache(str(tmp_path_factory.mktemp("cache") / "cache"), n_samples=48)


def _argv(cache: str, run: Path, *overrides: str) -> list[str]:
    return train_argv(BASE, cache, run, *overrides)


def _train(cache: str, run: Path, *overrides: str, capsys, caplog=None) -> tuple[int, str]:
    """``dflash-train`` in this process (the error paths need no fresh interpreter): exit code, stderr + log."""
    rc = main(_argv(cache, run, *overrides))
    err = capsys.readouterr().err
    if caplog is not None:
        err += "\n" + caplog.text
        caplog.clear()
    return rc, err


def _popen(cache: str, run: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, "-m", "train.cli", *_argv(cache, run, *overrides)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


# ----------------------------------------------------------------------------------------------
# the lock
# ----------------------------------------------------------------------------------------------


def test_second_trainer_is_refused_and_a_dead_holder_is_taken_over(cache, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    first = _popen(cache, run, "train.max_steps=100000", "checkpoint.every_steps=100000")
    t0 = time.time()
    while not read_metrics(run):  # the first trainer holds the lock and is training
        assert first.poll() is None, first.stderr.read()[-2000:]
        assert time.time() - t0 < 600
        time.sleep(0.05)
    rc, err = _train(cache, run, "train.max_steps=2", capsys=capsys)
    assert rc == 2
    assert f"in use: PID {first.pid} on host {socket.gethostname()}" in err and "another --run-dir" in err
    assert first.poll() is None  # the refused trainer did not disturb the running one
    steps_before = len(read_metrics(run))
    first.kill()
    first.wait()
    # the killed holder left its record (released: false); its flock died with it: the next trainer takes over.
    # It committed no checkpoint, so its metrics are kept aside and training starts from step 0.
    assert json.loads((run / "trainer.lock").read_text())["released"] is False
    rc, err = _train(cache, run, "train.max_steps=2", capsys=capsys, caplog=caplog)
    assert rc == 0, err
    assert f"taking over the lock of PID {first.pid}" in err
    kept = list(run.glob("metrics.before-*.jsonl"))
    assert len(kept) == 1 and len(kept[0].read_text().splitlines()) >= steps_before
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    holder = json.loads((run / "trainer.lock").read_text())
    assert holder["pid"] == os.getpid() and holder["released"] is True


def _fake_holder(run: Path, host: str, heartbeat: float) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "trainer.lock").write_text(json.dumps({"pid": 4242, "host": host, "started_unix": heartbeat - 100,
                                                  "heartbeat_unix": heartbeat, "argv": ["dflash-train"],
                                                  "released": False}))


def test_lock_held_from_another_host_is_judged_by_its_heartbeat(tmp_path):
    """A granted flock may be node-local on a cluster filesystem: another host's record is trusted while its
    heartbeat is fresh (refused if it advances), and taken over once it went stale."""
    fast = {"heartbeat_s": 0.05, "stale_after_s": 0.5}
    # stale for long: taken over at once
    run = tmp_path / "stale"
    _fake_holder(run, "node-b", time.time() - 3600)
    lock = RunDirLock(run, **fast)
    lock.acquire()
    assert Holder(**json.loads((run / "trainer.lock").read_text())).pid == os.getpid()
    lock.release()

    # alive: another process keeps beating
    run = tmp_path / "alive"
    _fake_holder(run, "node-b", time.time())
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            _fake_holder(run, "node-b", time.time())

    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(RunDirError, match=r"PID 4242 on host node-b .* is alive"):
            RunDirLock(run, **fast).acquire()
    finally:
        stop.set()
        t.join()

    # fresh but silent (its node just died): waited for, then taken over
    run = tmp_path / "silent"
    _fake_holder(run, "node-b", time.time())
    t0 = time.time()
    lock = RunDirLock(run, **fast)
    lock.acquire()
    assert time.time() - t0 >= 0.4
    lock.release()


# ----------------------------------------------------------------------------------------------
# resume refusals
# ----------------------------------------------------------------------------------------------


def test_every_config_field_has_a_resume_rule():
    fields = [f"{sec}.{key}" for sec, f in PipelineConfig.model_fields.items()
              for key in f.default_factory().__class__.model_fields]
    unclassified = [f for f in fields if f not in RESUME_RULES and f.split(".")[0] not in RESUME_RULES]
    assert not unclassified
    assert resume_rule("train.lr") == "result" and resume_rule("loader.tokens_per_batch") == "plan"
    assert resume_rule("metrics.wandb") == resume_rule("eval.every_steps") == "free"


@pytest.mark.parametrize(("arch", "change", "named"), [
    ("dflash", "model.arch=dflash2", 'model.arch: "dflash" -> "dflash2"'),
    ("dflash2", "model.arch=dflash", 'model.arch: "dflash2" -> "dflash"'),
    ("dflash", "model.intermediate_size=128", "model.intermediate_size: 256 -> 128"),
    ("dflash", "model.num_key_value_heads=1", "model.num_key_value_heads: 2 -> 1"),
    ("dflash2", "model.selector_rank=4", "model.selector_rank: 16 -> 4"),
])
def test_the_model_family_and_size_cannot_change_within_a_run_dir(cache, tmp_path, capsys, arch, change, named):
    """Even with checkpoint.allow_config_change the saved weights load only into the model they were trained as:
    a changed family or size is a one-line error naming the field (exit 2), before anything is written."""
    run = tmp_path / "run"
    assert _train(cache, run, f"model.arch={arch}", "train.max_steps=2", "checkpoint.every_steps=2",
                  capsys=capsys)[0] == 0
    for allow in ("false", "true"):
        rc, err = _train(cache, run, f"model.arch={arch}", change, "train.max_steps=4",
                         f"checkpoint.allow_config_change={allow}", capsys=capsys)
        assert rc == 2 and "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: ") and named in last and "new --run-dir" in last, last
        assert "another family or size" in last
    assert [r["step"] for r in read_metrics(run)] == [1, 2]  # nothing was touched by the refusals


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_with_a_changed_config(cache, tmp_path, capsys, caplog, optimizer):
    run = tmp_path / "run"
    opt = f"train.optimizer={optimizer}"
    assert _train(cache, run, opt, "train.max_steps=3", "checkpoint.every_steps=3", capsys=capsys)[0] == 0
    # lr and schedule: refused, naming the fields, until explicitly allowed
    rc, err = _train(cache, run, opt, "train.max_steps=6", "train.lr=1e-3", capsys=capsys)
    assert rc == 2
    assert "train.lr: 0.003 -> 0.001" in err and "train.max_steps: 3 -> 6" in err
    assert "checkpoint.allow_config_change=true" in err
    # the data plan: refused even with the override
    rc, err = _train(cache, run, opt, "train.max_steps=6", "loader.tokens_per_batch=1024",
                     "checkpoint.allow_config_change=true", capsys=capsys)
    assert rc == 2 and "loader.tokens_per_batch: 512 -> 1024" in err and "new --run-dir" in err
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # nothing was touched by the refusals
    # allowed: the new lrs apply from the resumed step on (the loaded optimizer state would carry the old ones)
    rc, err = _train(cache, run, opt, "train.max_steps=6", "train.lr=1e-3", "train.muon_lr=1e-2",
                     "eval.every_steps=50", "checkpoint.allow_config_change=true", capsys=capsys, caplog=caplog)
    assert rc == 0, err
    assert "changed config (checkpoint.allow_config_change):" in err and "train.lr: 0.003 -> 0.001" in err
    assert "do not change the result:" in err and "eval.every_steps: 100 -> 50" in err
    warmup = 1  # ceil(0.04 * 6)
    # train/lr is the first parameter group's: Muon's with train.optimizer = "muon", else AdamW's
    logged_peak = 1e-2 if optimizer == "muon" else 1e-3
    recs = {r["step"]: r for r in read_metrics(run)}
    for step in (4, 5, 6):  # lr of the step-th update under the new peak and the new 6-step schedule
        assert recs[step]["train/lr"] == pytest.approx(logged_peak * lr_lambda(step - 1, 6, warmup, 0.0), rel=1e-12)
    # every optimizer part took its own new peak: the schedule's base lr of each group, in the final checkpoint
    final = read_checkpoint(list_checkpoints(run)[-1][1])
    assert final.step == 6
    saved = final.state["optimizer"]
    parts = {"adamw": saved} if optimizer == "adamw" else saved
    assert list(parts) == {"adamw": ["adamw"], "muon": ["muon", "adamw"]}[optimizer]
    peaks = {"adamw": 1e-3, "muon": 1e-2}
    expected = [peaks[name] for name, part in parts.items() for _ in part["param_groups"]]
    assert final.state["scheduler"]["base_lrs"] == pytest.approx(expected, rel=1e-12)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_no_valid_checkpoint_is_refused_then_discarded_on_request(cache, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    assert _train(cache, run, "train.max_steps=4", "checkpoint.every_steps=2", capsys=capsys)[0] == 0
    for _, path in list_checkpoints(run):
        _flip_a_byte(path / "model.safetensors")
    before = (run / "metrics.jsonl").read_text()
    rc, err = _train(cache, run, "train.max_steps=4", "checkpoint.every_steps=2", capsys=capsys)
    assert rc == 2
    assert "holds 2 checkpoint(s) (step-00000002, step-00000004) but none is valid" in err
    assert "4 logged steps" in err and "checkpoint.discard_invalid=true" in err
    assert (run / "metrics.jsonl").read_text() == before  # not emptied
    rc, err = _train(cache, run, "train.max_steps=4", "checkpoint.every_steps=2", "checkpoint.discard_invalid=true",
                     capsys=capsys, caplog=caplog)
    assert rc == 0, err
    (discarded,) = run.glob("discarded-*")
    assert sorted(p.name for p in (discarded / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert (discarded / "metrics.jsonl").read_text() == before
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(run)] == [2, 4]


# ----------------------------------------------------------------------------------------------
# run dirs that cannot be written
# ----------------------------------------------------------------------------------------------


def test_run_dir_that_is_a_file(cache, tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("not a run dir")
    rc, err = _train(cache, target, "train.max_steps=1", capsys=capsys)
    assert rc == 2 and f"--run-dir {target} is a file, not a directory" in err and "Traceback" not in err
    rc, err = _train(cache, target / "run", "train.max_steps=1", capsys=capsys)
    assert rc == 2 and str(target) in err and "Traceback" not in err


def test_no_space_for_metrics(cache, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC
    rc, err = _train(cache, run, "train.max_steps=2", capsys=capsys)
    assert rc == 2, err
    assert f"cannot write {run / 'metrics.jsonl'}: No space left on device" in err
    assert "free space" in err and "Traceback" not in err


def test_read_only_run_dir(cache, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cmd = [sys.executable, "-m", "train.cli", *_argv(cache, run, "train.max_steps=1")]
    if os.geteuid() == 0:  # root ignores file modes: make the directory a read-only bind mount instead
        probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {run} {run}"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"running as root without mount namespaces: {probe.stderr.decode()[-200:]}")
        cmd = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && shift && '
               'exec "$@"', str(run), "--", *cmd]
    else:
        run.chmod(0o555)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    run.chmod(0o755)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot create the lock file {run / 'trainer.lock'}" in proc.stderr
    assert "make the run dir writable" in proc.stderr and "Traceback" not in proc.stderr

"""Live training through the real commands: ``dflash-train --set loader.live=true`` started before
``dflash-extract`` on the tiny preset waits for the cache, trains on the parts as they are committed and
ends cleanly once extraction has finished and everything is consumed; with two ranks (torchrun, gloo)
both plan the same windows."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_cache import open_cache
from dflash_cache.errors import ConfigError
from dflash_cache.runtime.config import load_config
from train.components.checkpoint import list_checkpoints, read_checkpoint
from train.components.metrics import read_metrics
from train.data.plan import holdout_mask

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny.toml"
LIVE = ["loader.live=true", "train.max_steps=100000", "train.epochs=1", "loader.live_poll_s=0.1",
        "loader.tokens_per_batch=1024", "train.num_anchors=8", "model.num_hidden_layers=1",
        "loader.live_timeout_s=240", "metrics.progress_bar=false", "metrics.tensorboard=false", "eval.every_steps=1000"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _training_tokens(cache_url: str, holdout_fraction: float) -> int:
    idx = open_cache(cache_url).index()
    ids = np.asarray(idx.sample_ids, dtype=np.int64)
    return int(idx.lengths[~holdout_mask(ids, holdout_fraction)].sum())


def _committed_parts(cache: Path) -> int:
    return len(list(cache.glob("buckets/*/*/commit.json")))  # a part's commit record is written last


def _wait(pred, what: str, *procs: subprocess.Popen, log: Path | None = None, timeout: float = 600.0) -> None:
    t0 = time.time()
    while not pred():
        for proc in procs:
            assert proc.poll() is None, f"exited early while waiting for {what}: " + (log.read_text()[-3000:] if log else "")
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)


def _extract_and_train(tmp_path: Path, trainer_prefix: list[str], *overrides: str) -> tuple[Path, Path, str, str]:
    """Start the trainer, then the extractor; pause the extractor (SIGSTOP) after its first committed part until
    the trainer has trained on it and waits for more, then let extraction finish. Returns cache, run, the
    trainer's stdout and its log."""
    cache, run, log = tmp_path / "cache", tmp_path / "run", tmp_path / "train.log"
    procs: list[subprocess.Popen] = []
    with open(log, "w") as err:
        try:
            trainer = subprocess.Popen([*trainer_prefix, str(CONFIG), "--cache", str(cache), "--run-dir", str(run),
                                        *_sets(*LIVE, *overrides)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                       stderr=err, text=True)
            procs.append(trainer)
            _wait(lambda: "live: waiting for extraction to create the cache" in log.read_text(), "the trainer", trainer,
                  log=log)
            assert not cache.exists()  # so every part is committed after the trainer started
            extract = subprocess.Popen([sys.executable, "-m", "extract.cli", str(CONFIG), "--out", str(cache),
                                        *_sets("metrics.progress_bar=false")], cwd=ROOT, env=_env(),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(extract)
            _wait(lambda: _committed_parts(cache) > 0, "a committed part", extract, trainer, log=log)
            extract.send_signal(signal.SIGSTOP)
            first = _committed_parts(cache)
            _wait(lambda: len(read_metrics(run)) > 0 and "consumed everything committed so far" in log.read_text(),
                  "the trainer to train on the first parts", trainer, log=log)
            trained_before = len(read_metrics(run))
            extract.send_signal(signal.SIGCONT)
            _, extract_err = extract.communicate(timeout=600)
            assert extract.returncode == 0, extract_err[-3000:]
            out, _ = trainer.communicate(timeout=600)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
    assert trainer.returncode == 0, log.read_text()[-4000:]
    assert 0 < first < _committed_parts(cache) and trained_before >= 1
    return cache, run, out, log.read_text()


def _windows(text: str) -> int:
    return len(re.findall(r"live: epoch 0 window \d+ plans", text))


def test_live_trainer_started_before_extraction_trains_on_every_committed_part(tmp_path):
    cache, run, out, log = _extract_and_train(tmp_path, [sys.executable, "-m", "train.cli"])
    steps = read_metrics(run)
    # it ended on its own, before max_steps: extraction finished and every part was consumed
    assert f"trained {len(steps)}/100000 steps" in out and [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    # one epoch over the live cache = exactly the tokens of every training sample, each sample once
    assert sum(r["train/n_tokens"] for r in steps) == _training_tokens(str(cache), 0.1)
    assert _windows(log) >= 2, log  # the parts committed before the pause, then those committed after it
    assert list_checkpoints(run)[-1][0] == len(steps)


def test_live_training_with_two_ranks_plans_the_same_windows(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(29700 + os.getpid() % 200), "-m", "train.cli"]
    cache, run, out, log = _extract_and_train(tmp_path, torchrun, "checkpoint.every_steps=1",
                                              "checkpoint.keep_last=100000")
    steps = read_metrics(run)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    # every checkpoint holds each rank's loader position: the windows planned so far are the same on both
    windows_seen = 0
    for _, path in list_checkpoints(run):
        per_rank = read_checkpoint(path).state["loader"]
        assert len(per_rank) == 2 and per_rank[0]["windows"] == per_rank[1]["windows"], path
        windows_seen = max(windows_seen, len(per_rank[0]["windows"]))
    assert windows_seen >= 2 and windows_seen == _windows(log), log


def test_live_mode_needs_max_steps_and_gives_up_waiting_after_its_timeout(tmp_path):
    with pytest.raises(ConfigError, match=r"train.max_steps: is required when loader.live = true"):
        load_config(CONFIG, ["loader.live=true"])
    cmd = [sys.executable, "-m", "train.cli", str(CONFIG), "--cache", str(tmp_path / "nowhere"), "--run-dir",
           str(tmp_path / "run"), *_sets("loader.live=true")]
    proc = subprocess.run([*cmd, *_sets("train.max_steps=5", "loader.live_poll_s=0.1", "loader.live_timeout_s=1")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "live: waited 1 s (loader.live_timeout_s) for extraction to create the cache at" in proc.stderr
    assert "Traceback" not in proc.stderr

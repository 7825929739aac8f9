"""What a real ``dflash-train`` run logs: every tag documented (docs/metrics.md, both ways), throughput that
measures training only, no step lost to a kill during evaluation, and Weights & Biases in offline mode."""

from __future__ import annotations

import json
import re
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
from fixtures.trainer import ROOT, run_train, small_cache, train_cmd, train_env

from train.components.metrics import MetricLogger, read_metrics
from train.config import MetricsConfig
from train.tools.report import analyze, format_report

BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.tokens_per_batch=512",
        "train.num_anchors=16", "loader.holdout_fraction=0.2"]
EVAL_DELAY_S = 1.5


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return small_cache(str(tmp_path_factory.mktemp("cache") / "cache"))


_cmd = partial(train_cmd, BASE)
_env = train_env
_run = partial(run_train, BASE, timeout=600)


def _tb_scalars(run: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def full_run(cache, tmp_path_factory) -> Path:
    """8 steps, a checkpoint and an evaluation every 4 (each evaluation made 1.5 s slow), a NaN at step 3."""
    run = tmp_path_factory.mktemp("full") / "run"
    _run(cache, run, "train.max_steps=8", "checkpoint.every_steps=4", "eval.every_steps=4", "guards.min_history=4",
         DFLASH_TEST_FAULTS='{"nan_steps": [3]}', DFLASH_TEST_EVAL_DELAY_S=str(EVAL_DELAY_S))
    return run


def _documented_tags() -> dict[str, tuple[str, bool]]:
    """docs/metrics.md's tag table: ``regex -> (kind, JSONL only)``."""
    out = {}
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| (`[^|]+`) \| (train|eval|save|commit) \| (.*) \|$", line)
        if m:
            for tag in re.findall(r"`([^`]+)`", m.group(1)):
                pattern = re.escape(tag).replace(re.escape("<b>"), r"\d+").replace(re.escape("<k>"), r"\d+")
                out[pattern] = (m.group(2), m.group(3).startswith("JSONL only"))
    return out


def test_every_tag_written_is_documented_and_every_documented_tag_is_written(full_run):
    documented = _documented_tags()
    assert len(documented) >= 30
    written: dict[str, set[str]] = {}
    for rec in read_metrics(full_run, kind=None):
        written.setdefault(rec["kind"], set()).update(k for k in rec if k not in ("step", "kind"))
    assert set(written) == {"train", "eval", "save", "commit"}
    matched = set()
    for kind, keys in written.items():
        for key in keys:
            hits = [p for p, (k, _) in documented.items() if re.fullmatch(p, key)]
            assert hits, f"{key} ({kind} record) is not in docs/metrics.md"
            assert documented[hits[0]][0] == kind, f"{key}: docs/metrics.md says kind {documented[hits[0]][0]}"
            matched.add(hits[0])
    assert set(documented) - matched == set(), "documented but never written"
    # TensorBoard holds exactly the scalar tags of the JSONL (the JSONL-only ones aside), under the same names
    jsonl_only = {k for keys in written.values() for k in keys
                  if any(re.fullmatch(p, k) and only for p, (_, only) in documented.items())}
    assert jsonl_only == {"train/skip_reason", "train/skipped_sample_ids"}
    assert set(_tb_scalars(full_run)) == {k for keys in written.values() for k in keys} - jsonl_only


def test_step_time_and_throughput_exclude_eval_and_checkpoints(full_run):
    recs = read_metrics(full_run, kind=None)
    train = {r["step"]: r for r in recs if r["kind"] == "train"}
    evals = {r["step"]: r for r in recs if r["kind"] == "eval"}
    saves = {r["step"]: r for r in recs if r["kind"] == "save"}
    assert sorted(train) == list(range(1, 9)) and sorted(evals) == [4, 8] and sorted(saves) == [4, 8]
    assert all(e["eval/seconds"] >= EVAL_DELAY_S for e in evals.values())
    # the step after an evaluation + checkpoint is not charged for them (the evaluation's own time, inflated by
    # the machine's load like the step's, includes a 1.5 s sleep that a charged step would include too)
    assert train[5]["train/step_time_s"] < evals[4]["eval/seconds"], (train[5], evals[4])
    for r in train.values():
        assert r["train/tokens_per_s"] == pytest.approx(r["train/n_tokens"] / r["train/step_time_s"], rel=1e-9)
    # file order: a step's train record, then its eval, then its save; the save's commit follows
    kinds = [(r["step"], r["kind"]) for r in recs]
    assert kinds.index((4, "train")) < kinds.index((4, "eval")) < kinds.index((4, "save"))
    assert [r["ckpt/committed_step"] for r in recs if r["kind"] == "commit"] == [4, 8]  # the last one too
    rep = analyze(recs)
    assert rep.seconds["held-out eval"] >= 2 * EVAL_DELAY_S > rep.seconds["training steps"] / 8
    assert "commit not logged" not in format_report(rep, full_run)


def _wait_for(pred, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, f"training exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
        assert time.time() - t0 < timeout, "timed out waiting for the training subprocess"
        time.sleep(0.02)


def _kinds(run: Path) -> set[tuple[int, str]]:
    return {(r["step"], r["kind"]) for r in read_metrics(run, kind=None)}


def test_sigkill_during_evaluation_loses_no_step(cache, tmp_path):
    """Kills aimed at a 1.5 s evaluation: once after checkpoint 3 committed (eval of step 4), once at a checkpoint
    step (eval of step 6, before its save). Where each kill landed is measured, then the rerun completes."""
    run = tmp_path / "run"
    args = ("train.max_steps=8", "checkpoint.every_steps=3", "eval.every_steps=2")
    landed = []
    for eval_step in (4, 6):
        proc = subprocess.Popen(_cmd(cache, run, *args), cwd=ROOT, env=_env(DFLASH_TEST_EVAL_DELAY_S=str(EVAL_DELAY_S)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_for(lambda s=eval_step: (s, "train") in _kinds(run), proc)
        time.sleep(0.3)  # well inside the evaluation (its teacher-forced pass, then 1.5 s)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kinds = _kinds(run)
        committed = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*") if p.suffix != ".tmp")
        landed.append((eval_step, (eval_step, "train") in kinds, (eval_step, "eval") in kinds, committed))
    # measured: each kill came after the step's record and before its evaluation's; checkpoint 3 was committed
    # before the first kill and checkpoint 6 was never saved (its evaluation comes first)
    assert landed == [(4, True, False, [3]), (6, True, False, [3])], landed
    _run(cache, run, *args)
    recs = read_metrics(run, kind=None)
    count = Counter((r["step"], r["kind"]) for r in recs)
    assert sorted(s for s, k in count if k == "train") == list(range(1, 9))
    assert sorted(s for s, k in count if k == "eval") == [2, 4, 6, 8]
    assert sorted(s for s, k in count if k == "save") == [3, 6, 8]
    assert {c for (_, k), c in count.items() if k != "commit"} == {1}  # nothing twice
    # (two commits can be noticed at one step; each checkpoint's commit is logged once)
    assert sorted(r["ckpt/committed_step"] for r in recs if r["kind"] == "commit") in ([6, 8], [3, 6, 8])
    assert _tb_scalars(run)["train/loss"] == list(range(1, 9))
    assert sorted(_tb_scalars(run)["eval/acceptance_length"]) == [2, 4, 6, 8]
    assert "no gaps, no duplicates" in format_report(analyze(recs), run)


# ----------------------------------------------------------------------------------------------
# Weights & Biases (offline: no network, no account)
# ----------------------------------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf records of an offline W&B run file (LevelDB log format: 32 KiB blocks of
    [crc32 u32, length u16, type u8] + data; type 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _wandb_run(run_file: Path) -> tuple[str, dict, dict[int, dict[str, float]]]:
    """(run id, config, {step: scalars}) of one offline W&B run."""
    run_id, config, history = "", {}, {}
    for rec in _wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    return run_id, config, history


def test_wandb_offline_logs_the_same_scalars_and_resume_continues_the_run(cache, tmp_path):
    run = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    common = ("metrics.wandb=true", "metrics.wandb_project=dflash-test", "checkpoint.every_steps=2",
              "eval.every_steps=2")
    _run(cache, run, "train.max_steps=4", *common, **env)
    run_id = (run / "wandb_run_id").read_text().strip()
    _run(cache, run, "train.max_steps=6", "checkpoint.allow_config_change=true", *common, **env)
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    attempts = [_wandb_run(f) for f in files]
    assert [a[0] for a in attempts] == [run_id, run_id]  # the resume continued the same W&B run
    assert attempts[0][1]["train"]["lr"] == 3e-3 and attempts[1][1]["train"]["max_steps"] == 6  # resolved config
    history = {**attempts[0][2], **attempts[1][2]}
    assert sorted(attempts[0][2]) == [1, 2, 3, 4] and sorted(attempts[1][2]) == [5, 6]
    # each W&B step holds exactly the scalars of that step's records in metrics.jsonl (all kinds), same names
    expected: dict[int, dict[str, float]] = {}
    for rec in read_metrics(run, kind=None):
        expected.setdefault(rec["step"], {}).update(
            {k: v for k, v in rec.items() if k not in ("step", "kind") and isinstance(v, int | float)})
    assert sorted(history) == sorted(expected) == list(range(1, 7))
    for step, scalars in expected.items():
        assert set(history[step]) == set(scalars), step
        for k, v in scalars.items():
            assert history[step][k] == pytest.approx(v, rel=1e-6), (step, k)


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    from dflash_cache.errors import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match=r"pip install wandb \(or, in the checkout, pip install -e '\.\[wandb\]'\)"):
        MetricLogger(tmp_path, MetricsConfig(wandb=True))

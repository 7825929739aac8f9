"""The demo pipeline (regenerate → extract → train → eval) at reduced size, through the real commands."""

from __future__ import annotations

import json

from dflash_cache.store import open_cache
from train.checkpoint import find_latest
from train.demo import run_demo
from train.evaluate import holdout_sample_ids
from train.metrics import read_metrics

# A quarter of the built-in prompts, shorter replies, fewer anchors per row; still enough steps to learn.
REDUCED = [
    "data.path=builtin:tiny-chat?n=96",
    "regenerate.max_new_tokens=64",
    "train.epochs=24",
    "train.num_anchors=16",
    "loader.tokens_per_batch=1024",
    "loader.holdout_fraction=0.15",
    "checkpoint.every_steps=100",
    "eval.every_steps=100",
    "eval.live_prompts=1",
    "eval.live_max_new_tokens=24",
    "metrics.progress_bar=false",
]


def test_demo_trained_drafter_beats_untrained(tiny_teacher_dir, tmp_path):
    out = tmp_path / "demo"
    summary = run_demo(out, "configs/tiny.toml", REDUCED, live=True)

    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert {"acceptance_length", "untrained_acceptance_length", "live_acceptance_length", "seconds"} <= set(summary)
    assert summary["heldout_blocks"] > 100
    # an untrained drafter accepts (almost) nothing; the trained one clearly more
    assert summary["untrained_acceptance_length"] < 1.1
    assert summary["acceptance_length"] > summary["untrained_acceptance_length"] + 0.3
    assert summary["live_acceptance_length"] >= 1.0
    # live decoding prompts come from held-out samples, never from the training set
    held = set(holdout_sample_ids(open_cache(summary["cache"]), 0.15).tolist())
    assert len(summary["live_prompt_sample_ids"]) == 1 and set(summary["live_prompt_sample_ids"]) <= held

    run = out / "run"
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == list(range(1, len(steps) + 1))
    assert any("eval/acceptance_length" in r for r in read_metrics(run, kind="eval"))
    assert find_latest(run) is not None
    assert (out / "regenerated.jsonl").stat().st_size > 0

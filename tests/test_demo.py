"""The demo pipeline (regenerate → extract → train → eval) at reduced size, through the real commands; the
commands it prints at the end work as printed in a fresh shell (the environment not active)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_cache.store import open_cache
from train.components.checkpoint import find_latest
from train.components.metrics import read_metrics
from train.demo import _print_summary, next_commands, run_demo
from train.tools.evaluate import holdout_sample_ids

ROOT = Path(__file__).resolve().parents[1]

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


@pytest.fixture(scope="module")
def demo(tiny_teacher_dir, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("demo") / "demo"
    return run_demo(out, "configs/tiny.toml", REDUCED, live=True), out


def test_demo_trained_drafter_beats_untrained(demo):
    summary, out = demo

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


def _fresh_shell_env() -> dict[str, str]:
    """The environment of a new terminal: this Python environment's scripts are not on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != Path(bin_dir).resolve())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PATH": path}


def test_printed_commands_work_in_a_fresh_shell(demo, capsys):
    summary, out = demo
    _print_summary(summary, out)
    printed = capsys.readouterr().out
    assert f"1.0 = no speed-up, {summary['block_size']} (the block size) = the ceiling" in printed
    env = _fresh_shell_env()
    assert shutil.which("dflash-train", path=env["PATH"]) is None  # the shell really is fresh
    commands = {what: cmd for what, cmd, _ in next_commands(summary)}
    assert all(cmd in printed for cmd in commands.values())

    def sh(cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=180)

    report = sh(commands["Run report"])
    assert report.returncode == 0, report.stderr
    assert "steps" in report.stdout
    tensorboard = sh(commands["TensorBoard"] + " --version_tb")  # the printed command, asked for its version only
    assert tensorboard.returncode == 0 and tensorboard.stdout.strip(), tensorboard.stderr
    activated = sh(f"{commands['Environment']} && command -v dflash-extract dflash-train dflash-cache tensorboard")
    assert activated.returncode == 0 and len(activated.stdout.split()) == 4, activated.stderr
    # the make targets named beside them run the same scripts of the project's environment
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), "report", "tensorboard", "RUN=runs/x"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert ".venv/bin/dflash-train report runs/x" in dry.stdout and ".venv/bin/tensorboard --logdir runs/x" in dry.stdout


def test_make_demo_passes_args_to_the_demo():
    # `make demo ARGS="--set …"`: the guard's stop message can be acted on without leaving make
    env = dict(os.environ)
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), "demo", "ARGS=--set guards.min_ratio=20 --keep"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "-m train.demo --out runs/demo --set guards.min_ratio=20 --keep" in dry.stdout

"""``accelerate launch`` runs both stages like ``torchrun`` (2 CPU processes, gloo).

accelerate 1.x starts N processes with the torchrun contract (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) through its multi-process launcher (``--multi_gpu``, which also runs on
CPU); ``--cpu --num_processes N`` starts a single process without ranks, which the commands refuse.

Every launch runs the console scripts (``--no-python dflash-train``), as documented, from a directory that
holds a ``train.py`` and an ``extract.py`` (common in ML repositories): the commands must not depend on
the current directory, as ``-m train.cli`` does. See docs/launchers.md.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_cache import open_cache
from extract.cli import main as extract_main
from train.components.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACCELERATE = [str(BIN / "accelerate"), "launch"]
needs_accelerate = pytest.mark.skipif(not (BIN / "accelerate").exists(),
                                      reason="accelerate is an optional extra: pip install -e '.[accelerate]'")
EXTRACT_SETS = ["data.path=builtin:tiny-chat?n=16", "extract.unit_size=4", "extract.tokens_per_batch=1024"]
TRAIN_SETS = ["model.mask_token_id=511", "metrics.progress_bar=false", "loader.holdout_fraction=0.0",
              "loader.tokens_per_batch=512", "train.num_anchors=512", "train.max_steps=2",
              "checkpoint.every_steps=2"]


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _env(tmp_path: Path) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # CPU processes even where GPUs exist; no user accelerate config (HF_HOME holds its default file); the
    # environment's scripts on PATH, as after `. .venv/bin/activate`
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf"),
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}


def _decoy_dir(tmp_path: Path) -> Path:
    """A working directory with its own train.py and extract.py, which `-m train.cli` would import."""
    d = tmp_path / "ml-repo"
    d.mkdir(exist_ok=True)
    for name in ("train", "extract"):
        (d / f"{name}.py").write_text(f"raise SystemExit('the decoy {name}.py of the current directory ran')\n")
    return d


def _launch(cmd: list[str], tmp_path: Path, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=_decoy_dir(tmp_path), env=_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == expect, proc.stderr[-3000:]
    assert "decoy" not in proc.stderr
    return proc


def test_module_form_breaks_in_a_directory_with_train_py_so_docs_use_the_console_scripts(tmp_path):
    # why the docs show `--no-python dflash-train`: with `-m`, the current directory comes first on sys.path
    proc = subprocess.run([sys.executable, "-m", "train.cli", "--help"], cwd=_decoy_dir(tmp_path),
                          env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "decoy train.py" in proc.stderr
    # so no command shown to users (code blocks of the pages, the presets' comments) uses the -m form
    shown = "\n".join(block for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                      for block in p.read_text().split("```")[1::2])
    shown += "\n".join(p.read_text() for p in (ROOT / "configs").glob("*.toml"))
    assert "-m train.cli" not in shown and "-m extract.cli" not in shown
    assert "--no-python dflash-train" in shown and "--no-python dflash-extract" in shown


def _snapshot(url: Path) -> dict[int, tuple[bytes, bytes, bytes]]:
    cache = open_cache(str(url))
    ids = cache.index().sample_ids.tolist()
    assert len(ids) == len(set(ids)), "a sample was written twice"
    return {s.sample_id: (s.input_ids.numpy().tobytes(), s.loss_mask.numpy().tobytes(),
                          s.features.view(torch.int16).numpy().tobytes()) for s in cache.read_samples(sorted(ids))}


@needs_accelerate
def test_extract_under_accelerate_two_processes_matches_one_process(tiny_teacher_dir, tmp_path):
    args = ["configs/tiny.toml", "--no-progress", *_sets(f"teacher.path={tiny_teacher_dir}", *EXTRACT_SETS)]
    single = tmp_path / "single"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert extract_main([*args, "--out", str(single)]) == 0
    finally:
        os.chdir(cwd)
    two = tmp_path / "accelerate"
    # the console script itself, as a user runs it (config path relative to the repository root), with its
    # progress bar
    args = [str(ROOT / args[0]), *[a for a in args[1:] if a != "--no-progress"]]
    proc = _launch([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
                    "no", "--dynamo_backend", "no", "--main_process_port", _port(), "--no_python", "dflash-extract",
                    *args, "--out", str(two)], tmp_path)
    assert "extraction: world size 2 (2 per node), backend gloo, devices: " in proc.stderr
    assert "rank 0 cpu, rank 1 cpu" in proc.stderr
    # rank 0's bar counts both ranks' samples and ends at the job's total, drawn once
    bars = [seg for line in proc.stderr.splitlines() for seg in line.split("\r") if seg.startswith("extract:")]
    assert bars and "100%" in bars[-1] and "16/16" in bars[-1], bars[-3:]
    assert sum("16/16" in b for b in bars) == 1, bars
    parts = open_cache(str(two)).parts()
    assert {p.meta["rank"] for p in parts} == {0, 1} and {p.meta["world_size"] for p in parts} == {2}
    ref = _snapshot(single)
    assert sorted(ref) == list(range(16))
    assert _snapshot(two) == ref  # same samples, tokens, masks and features, bit for bit


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    from dflash_cache.synthetic import make_synthetic_cache

    url = str(tmp_path_factory.mktemp("cache") / "cache")
    make_synthetic_cache(url, n_samples=32, hidden_size=64, num_layers=8, target_layer_ids=(1, 3, 5),
                         vocab_size=512, max_length=256, median_length=64, seed=0)
    return url


@needs_accelerate
def test_train_under_accelerate_matches_torchrun(cache, tmp_path):
    train = [str(ROOT / "configs" / "tiny.toml"), "--cache", cache, *_sets(*TRAIN_SETS)]
    torchrun, acc = tmp_path / "torchrun", tmp_path / "accelerate"
    proc = _launch(["torchrun", "--nproc-per-node", "2", "--master-port", _port(), "--no-python", "dflash-train",
                    *train, "--run-dir", str(torchrun)], tmp_path)
    # rank 0 says what the job runs on, for every rank
    assert "training: world size 2 (2 per node), backend gloo, devices: " in proc.stderr
    assert "rank 0 cpu, rank 1 cpu" in proc.stderr
    _launch([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
             "--dynamo_backend", "no", "--main_process_port", _port(), "--no_python", "dflash-train", *train,
             "--run-dir", str(acc)], tmp_path)
    a, b = read_metrics(torchrun), read_metrics(acc)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):  # the same ranks, data and reductions: bitwise equal
        assert (rb["train/loss"], rb["train/grad_norm"]) == (ra["train/loss"], ra["train/grad_norm"])


@needs_accelerate
def test_accelerate_cpu_flag_with_several_processes_is_refused(tmp_path):
    # accelerate --cpu --num_processes 2 starts ONE process without RANK/WORLD_SIZE (it leaves CPU ranks to
    # mpirun): running it would silently be a single-process job, so the command says how to launch instead
    proc = _launch([*ACCELERATE, "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no", "--no_python", "dflash-extract", str(ROOT / "configs" / "tiny.toml"),
                    "--out", str(tmp_path / "cache")], tmp_path, expect=1)
    assert "accelerate launch --multi_gpu --num_processes N" in proc.stderr
    assert not (tmp_path / "cache").exists()


def test_no_module_imports_accelerate():
    """accelerate is an optional extra (its launcher only): the pipeline must run without it installed."""
    importers = [str(p.relative_to(ROOT)) for pkg in ("dflash_cache", "extract", "train") for p in (ROOT / pkg).rglob("*.py")
                 if re.search(r"^\s*(import accelerate|from accelerate\b)", p.read_text(), re.M)]
    assert importers == []

"""Loss regression: a fixed-seed tiny training run's first steps against checked-in figures.

The run goes through the real entry point (``dflash-train`` on a synthetic cache built with a fixed seed),
so a silent numeric change anywhere on the path (plan, loader, batch assembly, anchors, drafter, loss,
optimizer, schedule) moves a figure and fails here. An intended change regenerates the file and says why
in its commit:

    .venv/bin/python tests/test_loss_regression.py   # rewrites tests/fixtures/loss_regression.json

Tolerance: relative 1e-4 on each step's loss and gradient norm. The runs are fp32 on CPU with one thread;
between machines only the summation order inside BLAS kernels may differ (1 vs 2 threads: identical
figures here). A real change of the computation moves the figures by more (measured: lr 3e-3 -> 2.9e-3
moves the loss by 1.5e-4 and the gradient norm by 4%; loss_gamma 7 -> 6.9 by 7e-4 and 18%; 15 anchors
instead of 16 by 9e-4 and 32%; dpace_alpha 0.5 -> 0.49 by 5% and 9%).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script too
from fixtures.trainer import small_cache, train_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "loss_regression.json"
STEPS = 8
RTOL = 1e-4
BASE = ["model.mask_token_id=511", "metrics.progress_bar=false", "metrics.tensorboard=false",
        "loader.holdout_fraction=0.0", "loader.tokens_per_batch=512", "train.num_anchors=16",
        f"train.max_steps={STEPS}", "checkpoint.every_steps=1000", "train.seed=0"]
# each recipe names its choices explicitly: a change of the preset's defaults is not a numeric regression
RUNS = {
    "exp_decay+adamw": ["train.loss_weighting=exp_decay", "train.optimizer=adamw"],
    "dpace+muon+packing": ["train.loss_weighting=dpace", "train.optimizer=muon", "train.muon_lr=3e-2",
                           "loader.packing=true"],
}
KEYS = ("train/loss", "train/grad_norm")


def build_cache(url: str) -> None:
    small_cache(url, n_samples=48, seed=0)


def run_recipe(cache: str, run_dir: Path, overrides: list[str], threads: int = 1) -> dict[str, list[float]]:
    """Train ``STEPS`` steps through ``dflash-train`` in this process with ``threads`` intra-op threads; each
    key's per-step values."""
    import torch

    from train.cli import main
    from train.metrics import read_metrics

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rc = main(train_argv(BASE, cache, run_dir, *overrides))
    finally:
        torch.set_num_threads(before)
    assert rc == 0, f"dflash-train exited {rc}"
    recs = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    return {k: [float(r[k]) for r in recs] for k in KEYS}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("cache") / "cache")
    build_cache(url)
    return url


@pytest.mark.parametrize("name", list(RUNS))
def test_first_steps_match_the_checked_in_figures(cache, tmp_path, name):
    expected = json.loads(FIXTURE.read_text())
    assert (expected["steps"], expected["base"], expected["runs"][name]["overrides"]) == (STEPS, BASE, RUNS[name]), (
        f"{FIXTURE} was written for other settings: regenerate it (see this file's docstring)")
    got = run_recipe(cache, tmp_path / "run", RUNS[name])
    for key in KEYS:
        want = expected["runs"][name][key]
        for step, (g, w) in enumerate(zip(got[key], want, strict=True), start=1):
            assert g == pytest.approx(w, rel=RTOL), (
                f"{name}: {key} at step {step} is {g!r}, the checked-in figure {w!r} (rel tol {RTOL}); if the "
                f"change is intended, regenerate {FIXTURE.name} and say why in the commit")


def write_fixture(workdir: Path) -> None:
    """Regenerate the checked-in figures (run this file as a script)."""
    url = str(workdir / "cache")
    build_cache(url)
    out = {"steps": STEPS, "rtol": RTOL, "base": BASE, "runs": {}}
    for name, overrides in RUNS.items():
        out["runs"][name] = {"overrides": overrides, **run_recipe(url, workdir / name, overrides)}
    FIXTURE.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as d:
        write_fixture(Path(d))

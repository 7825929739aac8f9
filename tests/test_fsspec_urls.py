"""Both stages work on an fsspec URL, not only a local path (memory:// here; s3:// and gs:// go the same way)."""

from __future__ import annotations

from dflash_cache import open_cache, verify_cache
from extract.cli import main as extract_main
from train.cli import main as train_main
from train.components.checkpoint import find_latest


def test_extract_then_train_on_a_memory_url(tiny_teacher_dir, tmp_path):
    url = f"memory://fsspec-{tmp_path.name}/cache"
    sets = ["--set", "data.path=builtin:tiny-chat?n=40", "--set", "metrics.progress_bar=false"]
    assert extract_main(["configs/tiny.toml", "--out", url, "--no-progress", *sets]) == 0
    report = verify_cache(url)
    assert report.n_samples == 40 and not report.problems
    assert open_cache(url).has_head()

    run = tmp_path / "run"
    assert train_main(["configs/tiny.toml", "--cache", url, "--run-dir", str(run), *sets,
                       "--set", "train.max_steps=3", "--set", "checkpoint.every_steps=2"]) == 0
    latest = find_latest(run)
    assert latest is not None and latest.name == "step-00000003"

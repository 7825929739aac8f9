"""``make demo``: the whole pipeline on the embedded default, end to end, on CPU.

regenerate (the tiny teacher answers the built-in prompts) → extract (features into a zarr cache)
→ train (the drafter, with checkpoints and TensorBoard logs) → eval (teacher-forced acceptance of the
trained drafter next to an untrained one, and live speculative decoding with the teacher).

Every stage runs through the same command-line entry points a user types; the figures land in
``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_cache.errors import DFlashError
from dflash_cache.protocols import ReadableCache
from dflash_cache.runtime.entry import command_parser, run_cli

log = logging.getLogger("dflash.demo")


class StageFailed(DFlashError):
    """A pipeline stage returned a non-zero exit code."""


def _stage(name: str, main: Any, argv: list[str]) -> None:
    log.info("== %s: %s", name, " ".join(argv))
    rc = main(argv)
    if rc:
        raise StageFailed(f"demo stage {name!r} failed with exit code {rc} (its error is printed above)")


def _untrained_drafter(cfg: Any, cache: ReadableCache) -> Any:
    import torch

    from .models.factory import build_drafter

    torch.manual_seed(cfg.train.seed)  # the same initialisation the trainer starts from
    return build_drafter(cfg.model, cache.spec, cache.load_head()).eval()


def evaluate(config: str, overrides: Sequence[str], cache_url: str, run_dir: Path, live: bool) -> dict[str, Any]:
    """Held-out teacher-forced τ of the trained and an untrained drafter, and live τ of the trained one."""
    from dflash_cache import open_cache
    from dflash_cache.runtime.config import load_config
    from dflash_cache.runtime.threads import budget_cpu_threads

    from .tools.evaluate import holdout_sample_ids, load_for_eval, run_live, teacher_forced_eval

    cfg = load_config(config, overrides)
    budget_cpu_threads("cpu", cfg.loader.num_readers)  # the stages' CLIs set theirs; this one runs here
    cache = open_cache(cache_url)
    ids = holdout_sample_ids(cache, cfg.loader.holdout_fraction)
    trained = load_for_eval(str(run_dir), cache, cfg.model.attention)
    tf_trained = teacher_forced_eval(trained, cache, ids, max_blocks=cfg.eval.max_blocks)
    tf_untrained = teacher_forced_eval(_untrained_drafter(cfg, cache), cache, ids, max_blocks=cfg.eval.max_blocks)
    out: dict[str, Any] = {
        "block_size": cfg.model.block_size,
        "acceptance_length": tf_trained.acceptance_length,
        "untrained_acceptance_length": tf_untrained.acceptance_length,
        "per_position_accuracy": tf_trained.per_position_accuracy,
        "heldout_samples": tf_trained.n_samples,
        "heldout_blocks": tf_trained.n_blocks,
    }
    if live:
        res = run_live(trained, cfg.eval, cfg.teacher, cache, ids)  # prompts from held-out samples, like the teacher-forced eval
        out["live_acceptance_length"] = res["tau"]
        out["live_tau_per_prompt"] = res["tau_per_prompt"]
        out["live_prompt_sample_ids"] = [p["sample_id"] for p in res["prompts"]]
        out["live_tau_convention"] = res["tau_convention"]
    return out


def run_demo(out: Path, config: str = "configs/tiny.toml", overrides: Sequence[str] = (), live: bool = True,
             fresh: bool = True) -> dict[str, Any]:
    from extract.cli import main as extract_main

    from .cli import main as train_main

    if fresh:
        log.info("the demo writes into %s and replaces what an earlier demo left there (--keep resumes into it)",
                 out)
        if out.exists():
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    sets = [a for o in overrides for a in ("--set", o)]
    regenerated, cache, run_dir = out / "regenerated.jsonl", out / "cache", out / "run"
    t0 = time.perf_counter()
    _stage("regenerate", extract_main, ["regenerate", config, "--out", str(regenerated), *sets])
    _stage("extract", extract_main, [config, "--data", str(regenerated), "--out", str(cache), *sets])
    _stage("train", train_main, [config, "--cache", str(cache), "--run-dir", str(run_dir), *sets])
    log.info("== eval: held-out teacher-forced acceptance%s", " and live speculative decoding" if live else "")
    summary = evaluate(config, overrides, str(cache), run_dir, live)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["run_dir"] = str(run_dir)
    summary["cache"] = str(cache)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def script(name: str) -> str:
    """How to type this environment's console script ``name`` in a fresh shell, where the environment is not
    active: its path, relative to the current directory when below it (``.venv/bin/tensorboard``)."""
    path = Path(sys.executable).parent / name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def next_commands(s: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(what, command, note)`` the demo suggests at its end; each command works as printed in a fresh shell."""
    run = s["run_dir"]
    return [
        ("TensorBoard", f"{script('tensorboard')} --logdir {run}", f"(or: make tensorboard RUN={run})"),
        ("Run report", f"{script('dflash-train')} report {run}", f"(or: make report RUN={run})"),
        ("Environment", f". {script('activate')}", "puts dflash-extract, dflash-train, dflash-cache and tensorboard "
                                                   "on PATH"),
    ]


def _print_summary(s: dict[str, Any], out: Path) -> None:
    print()
    print(f"acceptance length (held-out, teacher-forced): trained {s['acceptance_length']:.3f}"
          f"  vs untrained {s['untrained_acceptance_length']:.3f}")
    if "live_acceptance_length" in s:
        print(f"live speculative decoding with the teacher:   tau {s['live_acceptance_length']:.3f}"
              f" on {len(s['live_tau_per_prompt'])} held-out prompts (output identical to the teacher's greedy "
              "decoding)")
    print(f"(acceptance length tau = tokens per teacher forward: 1.0 = no speed-up, {s['block_size']} (the block "
          "size) = the ceiling)")
    print(f"whole demo: {s['seconds']:.0f} s; figures in {out / 'summary.json'}")
    for what, cmd, note in next_commands(s):
        print(f"{what + ':':<13}{cmd}   {note}")


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "python -m train.demo",
        "Run the whole pipeline on the embedded default (a tiny teacher built locally) on CPU: regenerate, "
        "extract, train, then evaluate the drafter teacher-forced and by live speculative decoding.",
        "It replaces --out (runs/demo) unless --keep is given, and writes its figures to OUT/summary.json.")
    p.add_argument("--out", default="runs/demo", help="output directory (replaced unless --keep)")
    p.add_argument("--config", default="configs/tiny.toml", help="TOML preset (default: configs/tiny.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable)")
    p.add_argument("--no-live", action="store_true", help="skip live speculative decoding")
    p.add_argument("--keep", action="store_true", help="resume into an existing --out instead of starting fresh")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from dflash_cache.runtime.config import load_config

    load_config(args.config, args.overrides)  # a typo fails here, before torch is loaded and --out replaced
    out = Path(args.out)
    summary = run_demo(out, args.config, args.overrides, live=not args.no_live, fresh=not args.keep)
    _print_summary(summary, out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

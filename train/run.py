"""``dflash-train CONFIG --cache CACHE --run-dir RUN``: train (or resume) a drafter.

The command line only: the loop is :func:`train.loop.train`. Rerunning the same command resumes from
the latest committed checkpoint in RUN.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dflash_cache.runtime.config import load_config

from .loop import train


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash drafter from a feature cache. Rerunning the same command resumes "
        "from the latest checkpoint in --run-dir. Subcommands: eval, export, report.",
    )
    p.add_argument("config", help="TOML preset, e.g. configs/tiny.toml")
    p.add_argument("--cache", required=True, help="feature cache (path or fsspec URL) from dflash-extract")
    p.add_argument("--run-dir", required=True, help="where checkpoints, metrics.jsonl and TensorBoard logs go")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=100 (repeatable)")
    return p


def cli_main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    result = train(cfg, args.cache, args.run_dir)
    if result.checkpoint is not None:
        print(f"trained {result.step}/{result.total_steps} steps ({result.skipped} skipped); "
              f"checkpoint: {result.checkpoint}")
    return 0

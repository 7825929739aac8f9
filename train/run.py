"""``dflash-train CONFIG --cache CACHE --run-dir RUN``: train (or resume) a drafter.

The command line only: the loop is :func:`train.loop.loop.train`. Rerunning the same command resumes from
the latest committed checkpoint in RUN.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.entry import command_parser
from dflash_cache.runtime.schema import TRAIN_COMMAND


def build_parser() -> argparse.ArgumentParser:
    from .cli import COMMAND

    p = command_parser(
        "dflash-train",
        "Train a DFlash drafter from a feature cache written by dflash-extract. Rerunning the same command "
        "resumes from the latest checkpoint in --run-dir.",
        "Under torchrun (torchrun --nproc-per-node N --no-python dflash-train ...) each process is one "
        "data-parallel replica. Metrics go to RUN/metrics.jsonl and TensorBoard (docs/metrics.md).",
        epilog=COMMAND.epilog())
    p.add_argument("config", help="TOML preset, e.g. configs/tiny.toml (keys: docs/config.md)")
    p.add_argument("--cache", required=True, help="feature cache (path or fsspec URL) from dflash-extract")
    p.add_argument("--run-dir", required=True, help="where checkpoints, metrics.jsonl and TensorBoard logs go")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=100 (repeatable)")
    return p


def cli_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides, command=TRAIN_COMMAND)  # before torch is loaded: a typo costs no import
    from .loop.loop import train

    result = train(cfg, args.cache, args.run_dir)
    if result.checkpoint is not None:
        print(f"trained {result.step}/{result.total_steps} steps ({result.skipped} skipped); "
              f"checkpoint: {result.checkpoint}")
    return 0

"""``dflash-extract CONFIG --out CACHE``: the command. It parses the arguments, loads the config and runs
the extraction loop (:mod:`extract.loop`); the pieces the other subcommands share are
:mod:`extract.run_config`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dflash_cache.runtime.entry import command_parser
from dflash_cache.runtime.log import process_rank

from .loop import run_extraction
from .run_config import load_run_config


def build_parser() -> argparse.ArgumentParser:
    from .cli import COMMAND

    p = command_parser(
        "dflash-extract",
        "Run the teacher over the conversations and write the hidden states the drafter needs into a feature "
        "cache (a zarr group at a path or fsspec URL).",
        "Rerunning the same command after a crash or preemption resumes: finished work units are kept, partial "
        "ones recomputed. Under torchrun (torchrun --nproc-per-node N --no-python dflash-extract ...) each process "
        "takes its share of the work units.",
        epilog=COMMAND.epilog())
    p.add_argument("config", help="TOML preset, e.g. configs/tiny.toml (keys: docs/config.md)")
    p.add_argument("--out", required=True, help="cache path or fsspec URL (created, or resumed)")
    p.add_argument("--data", help="input data (overrides data.path)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--skip-bad", action="store_true", help="count and skip malformed records instead of failing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def cli_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    cfg = load_run_config(args.config, args.set, args.data, args.skip_bad)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report = run_extraction(cfg, args.out, progress=not args.no_progress)
    if process_rank() == 0:
        print(f"extracted into {args.out}")
        for line in report.lines():
            print("  " + line)
    return 0

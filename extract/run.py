"""``dflash-extract CONFIG --out CACHE``: the command. Its arguments (and the config they name) are checked by
:mod:`extract.cli_args` before this module, and torch with it, is imported; it runs the extraction loop
(:mod:`extract.loop`); the pieces the other subcommands share are :mod:`extract.run_config`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_cache.runtime.log import process_rank

from .cli_args import extract_parser as build_parser
from .cli_args import load_run_config
from .loop import run_extraction

__all__ = ["build_parser", "cli_main"]


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

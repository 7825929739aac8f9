"""The parsers of ``dflash-extract`` and its ``estimate`` and ``regenerate`` subcommands, and the checks of their
arguments and config that need no torch.

The commands' modules import torch (~5 s of CPU, ~90 s on a busy machine); :func:`dispatch
<dflash_cache.runtime.entry.dispatch>` runs these first, so ``--help``, a mistyped option or ``--set`` key and a
missing config file answer at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dflash_cache.errors import ConfigError
from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.entry import Arguments, command_parser, finite_float
from dflash_cache.runtime.schema import EXTRACT_COMMAND, PipelineConfig

DEFAULT_TOKENS_PER_S = 26_000  # a 27B-width drafter step on one H200 (README performance table)


def extract_parser() -> argparse.ArgumentParser:
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


def load_run_config(path: str, overrides: Sequence[str], data: str | None, skip_bad: bool) -> PipelineConfig:
    cfg = load_config(path, overrides, command=EXTRACT_COMMAND)
    try:
        if data is not None:
            cfg.data.path = data
        if skip_bad:
            cfg.data.skip_bad = True
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg


def estimate_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "dflash-extract estimate",
        "Tokenize the data with the teacher's chat template and print the sample and token counts, the length "
        "buckets and the projected cache size per codec, without loading the teacher's weights.")
    p.add_argument("config", help="TOML preset, e.g. configs/qwen3-8b.toml (keys: docs/config.md)")
    p.add_argument("--data", help="input data (overrides data.path)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--skip-bad", action="store_true", help="count and skip malformed records instead of failing")
    p.add_argument("--tokens-per-s", type=finite_float, default=DEFAULT_TOKENS_PER_S,
                   help="training speed to size the read bandwidth and reader cores for (all ranks together)")
    p.add_argument("--decode-gbps", action="append", default=[], metavar="CODEC=GBPS",
                   help="decoded GB/s per reader core measured for a codec (repeatable), e.g. bf16-zstd=1.1")
    return p


def regenerate_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "dflash-extract regenerate",
        "Replace every assistant turn of the conversations with the teacher's own reply, so that the drafter "
        "learns the target's distribution, and write them as JSONL that dflash-extract reads with --data.",
        "Without --endpoint the teacher generates in this process (Hugging Face generate, batched); with "
        "--endpoint an OpenAI-compatible server (vllm serve, SGLang) does, and OUT is an append-only log that a "
        "rerun resumes. See docs/regenerate.md.")
    p.add_argument("config", help="TOML preset, e.g. configs/qwen3-8b.toml (keys: docs/config.md)")
    p.add_argument("--data", help="input conversations (overrides data.path)")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--endpoint", metavar="URL",
                   help="OpenAI-compatible server to ask (sets regenerate.endpoint); default: HF generate in-process")
    p.add_argument("--served-model", metavar="NAME",
                   help="served model to request, vouching that it is the teacher (sets regenerate.served_model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--skip-bad", action="store_true", help="count and skip malformed records instead of failing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_config(args: argparse.Namespace) -> None:
    load_run_config(args.config, args.set, args.data, args.skip_bad)


EXTRACT = Arguments(extract_parser, _check_config)
ESTIMATE = Arguments(estimate_parser, _check_config)
REGENERATE = Arguments(regenerate_parser, _check_config)

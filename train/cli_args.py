"""The parsers of ``dflash-train eval``, ``export`` and ``report``, and the checks of their arguments and
config that need no torch.

The subcommands' modules import torch (~5 s of CPU, ~90 s on a busy machine); :func:`dispatch
<dflash_cache.runtime.entry.dispatch>` runs these first, so ``--help``, a mistyped option or ``--set`` key and a
missing config file answer at once.
"""

from __future__ import annotations

import argparse

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.entry import Arguments, command_parser, finite_float
from dflash_cache.runtime.schema import TRAIN_COMMAND

EXPORT_DTYPES = ["bfloat16", "float16", "float32"]  # train.tools.export's weight dtypes, by name


def eval_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "dflash-train eval",
        "Measure a drafter's acceptance length tau (tokens per target forward): teacher-forced over every "
        "eligible anchor of the cache's held-out samples, and with --live by real greedy speculative decoding "
        "with the teacher, checked token for token against the teacher's own greedy output (or, with --temperature, "
        "by speculative sampling, lossless in distribution).",
        "tau = 1.0 means no speed-up; the block size is the ceiling.")
    p.add_argument("config", help="TOML preset (the run's config): model/loader/eval/teacher sections")
    p.add_argument("--cache", required=True, help="feature cache URL (held-out samples and the frozen head)")
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, run dir (latest checkpoint) or drafter dir")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable)")
    p.add_argument("--samples", choices=["holdout", "all"], default="holdout",
                   help="evaluate (teacher-forced, and live prompts) on the held-out samples (default) or the whole "
                        "cache (which includes the training samples)")
    p.add_argument("--live", action="store_true", help="also run live speculative decoding with the teacher")
    p.add_argument("--temperature", type=finite_float, default=0.0,
                   help="--live: verify by speculative sampling at this temperature (lossless in distribution); "
                        "0 (default) = greedy, checked token for token")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="--live with --temperature: nucleus sampling (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="--live with --temperature: top-k sampling (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="--live with --temperature: the sampling seed")
    p.add_argument("--card-tau", action="store_true",
                   help="--live: also report tau in the published model cards' convention (dflash 0.1.0: the last "
                        "cycle clipped at the budget and the stop token), beside the reference 44947fb's")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def export_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "dflash-train export",
        "Write a drafter as a Hugging Face directory that SGLang and vLLM load as a DFlash draft model: "
        "config.json, model.safetensors with the released drafters' weight names (no embedding, no lm_head) and "
        "the modeling file dflash.py. See docs/serving.md.",
        "The target's vocabulary size and layer ids come from the checkpoint when it records them, else from "
        "--cache.")
    p.add_argument("checkpoint", help="a run dir (latest committed checkpoint), a checkpoint dir, or a drafter dir")
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--cache", help="the cache the drafter was trained on (when the checkpoint does not record "
                   "the target's vocabulary and layer ids)")
    p.add_argument("--dtype", default="bfloat16", choices=EXPORT_DTYPES, help="dtype of the written weights "
                   "(default: bfloat16)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def report_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "dflash-train report",
        "Summarise a run from RUN/metrics.jsonl: loss spikes with their step, bucket and grad norm, steps the "
        "guards skipped and why, gaps in the step sequence, checkpoint saves, held-out evaluations, where the "
        "wall time went, and loader starvation.",
        "With --png it also draws the loss, acceptance length and grad norm (with the guard's limit) over steps, "
        "with spikes, skips and saves marked.")
    p.add_argument("run_dir", help="a run directory written by dflash-train")
    p.add_argument("--png", help="also write a figure to this file")
    p.add_argument("--window", type=int, default=64, help="trailing window (steps) for spike z-scores")
    p.add_argument("--z", type=finite_float, default=6.0, help="robust z-score above which a loss is a spike")
    return p


def _check_config(args: argparse.Namespace) -> None:
    load_config(args.config, args.overrides, command=TRAIN_COMMAND)


EVAL = Arguments(eval_parser, _check_config)
EXPORT = Arguments(export_parser)
REPORT = Arguments(report_parser)

"""``dflash-train``: train (default), ``estimate``, ``eval``, ``export`` and ``report`` subcommands.

Each subcommand module owns its own argument parser (``build_parser()``, run by ``cli_main(argv)``); this
file only names them. Where a module imports torch, its parser lives in :mod:`train.cli_args` and runs first.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dflash_cache.runtime.entry import Command, Subcommand, dispatch, run_cli

COMMAND = Command(
    prog="dflash-train",
    module="train.run",
    subcommands={
        "estimate": Subcommand("train.tools.estimate", "Predict the memory, compute and time of a training step and of "
                               "the run before it starts, without loading any weights."),
        "eval": Subcommand("train.tools.evaluate", "Measure a drafter's acceptance length on held-out samples, and with "
                           "--live by real speculative decoding with the teacher.", arguments="train.cli_args:EVAL"),
        "export": Subcommand("train.tools.export", "Write a checkpoint as a Hugging Face directory that SGLang and vLLM "
                             "load as a DFlash draft model.", arguments="train.cli_args:EXPORT"),
        "report": Subcommand("train.tools.report", "Summarise a run's logs: loss spikes, skipped steps, gaps, checkpoint "
                             "saves, evaluations and where the time went.", arguments="train.cli_args:REPORT"),
    },
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda args: dispatch(args, COMMAND), argv)


if __name__ == "__main__":
    sys.exit(main())

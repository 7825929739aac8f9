"""``dflash-extract``: extract (default), ``estimate`` and ``regenerate`` subcommands.

Each subcommand module owns its own argument parser (``build_parser()``, run by ``cli_main(argv)``); this
file only names them. Their parsers live in :mod:`extract.cli_args` and run before the modules (which import
torch) are loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dflash_cache.runtime.entry import Command, Subcommand, dispatch, run_cli

COMMAND = Command(
    prog="dflash-extract",
    module="extract.run",
    arguments="extract.cli_args:EXTRACT",
    subcommands={
        "estimate": Subcommand("extract.estimate", "Count samples and tokens after templating and project the "
                               "cache size per codec, without loading the teacher's weights.",
                               arguments="extract.cli_args:ESTIMATE"),
        "regenerate": Subcommand("extract.regenerate", "Replace every assistant turn with the teacher's own reply "
                                 "(in this process, or through an OpenAI-compatible server) and write JSONL.",
                                 arguments="extract.cli_args:REGENERATE"),
    },
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda args: dispatch(args, COMMAND), argv)


if __name__ == "__main__":
    sys.exit(main())

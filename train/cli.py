"""``dflash-train``: train (default), ``eval``, ``export`` and ``report`` subcommands.

Each subcommand module owns its own argument parser (``cli_main(argv)``); this file only dispatches.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dflash_cache.runtime.entry import dispatch, run_cli

SUBCOMMANDS = {
    "estimate": "train.estimate",
    "eval": "train.evaluate",
    "export": "train.export",
    "report": "train.report",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda args: dispatch(args, SUBCOMMANDS, "train.run"), argv)


if __name__ == "__main__":
    sys.exit(main())

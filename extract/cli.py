"""``dflash-extract``: extract (default), ``estimate`` and ``regenerate`` subcommands."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dflash_cache.runtime.entry import dispatch, run_cli

SUBCOMMANDS = {
    "estimate": "extract.estimate",
    "regenerate": "extract.regenerate",
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda args: dispatch(args, SUBCOMMANDS, "extract.run"), argv)


if __name__ == "__main__":
    sys.exit(main())

"""``dflash-extract``: extract (default), ``estimate`` and ``regenerate`` subcommands."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dflash_cache.entry import run_cli

SUBCOMMANDS = {
    "estimate": "extract.estimate",
    "regenerate": "extract.regenerate",
}


def _dispatch(argv: Sequence[str] | None) -> int | None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        import importlib

        module = importlib.import_module(SUBCOMMANDS[args[0]])
        return module.cli_main(args[1:])
    from extract.run import cli_main

    return cli_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_dispatch, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Shared plumbing for the console scripts: logging setup and user-facing error handling."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Mapping, Sequence

from ..errors import DFlashError
from .dist import check_launcher_env
from .log import setup_logging

log = logging.getLogger("dflash")


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; a :class:`DFlashError` becomes its message on stderr and its exit code."""
    setup_logging()
    try:
        check_launcher_env()
        rc = main(argv)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


def dispatch(argv: Sequence[str] | None, subcommands: Mapping[str, str], default: str) -> int | None:
    """Run ``<module>.cli_main(rest)`` for ``argv[0]`` in ``subcommands``, else ``<default>.cli_main(argv)``.

    Modules are imported on use, so ``--help`` of one subcommand does not load the others' dependencies.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in subcommands:
        return importlib.import_module(subcommands[args[0]]).cli_main(args[1:])
    return importlib.import_module(default).cli_main(args)

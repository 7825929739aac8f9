"""Shared plumbing for the console scripts: logging setup and user-facing error handling."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from .errors import DFlashError
from .log import setup_logging

log = logging.getLogger("dflash")


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; a :class:`DFlashError` becomes its message on stderr and its exit code."""
    setup_logging()
    try:
        rc = main(argv)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)

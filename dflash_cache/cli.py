"""``dflash-cache``: info / verify / gc."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dflash_cache.entry import run_cli


def _main(argv: Sequence[str] | None) -> int | None:
    raise NotImplementedError("dflash-cache is being built (issue 2)")


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

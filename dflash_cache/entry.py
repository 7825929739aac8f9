"""Shared plumbing for the console scripts: logging setup and user-facing error handling."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from .errors import ConfigError, DFlashError
from .log import setup_logging

log = logging.getLogger("dflash")


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; a :class:`DFlashError` becomes its message on stderr and its exit code."""
    setup_logging()
    try:
        check_launcher_env(os.environ)
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


def check_launcher_env(env: Mapping[str, str]) -> None:
    """Refuse a launch that asked for several processes but gives this one no rank.

    ``accelerate launch --cpu --num_processes N`` (N > 1) sets MASTER_ADDR/PORT but neither RANK nor
    WORLD_SIZE: it starts one process, or leaves the ranks to mpirun's variables (``--mpirun_hostfile``),
    which the commands do not read; each process would run the whole job as if alone.
    """
    if env.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1") and "MASTER_ADDR" in env \
            and "WORLD_SIZE" not in env:
        raise ConfigError(
            "launched by `accelerate launch --cpu` with several processes, but this process has no RANK/WORLD_SIZE "
            "(accelerate starts one process on CPU, or leaves the ranks to mpirun): it would run the whole job "
            "alone. For N CPU processes use `accelerate launch --multi_gpu --num_processes N ...` (torchrun's "
            "launcher; runs on CPU with gloo) or `torchrun --nproc-per-node N ...`; for one process drop "
            "--num_processes. See docs/launchers.md"
        )

"""Shared plumbing for the console scripts: logging setup, user-facing errors, subcommand dispatch and help."""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import math
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import DFlashError, UsageError
from .launcher import check_launcher_env
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


@dataclass(frozen=True)
class Arguments:
    """A command's parser and the checks of its arguments and config that need no torch: they run before the
    command's module (which imports torch, ~5 s of CPU, ~90 s on a busy machine) is loaded, so a typo costs none."""

    build_parser: Callable[[], argparse.ArgumentParser]
    check: Callable[[argparse.Namespace], object] | None = None  # e.g. load the config with its overrides

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        args = self.build_parser().parse_args(list(argv))
        if self.check is not None:
            self.check(args)
        return args


@dataclass(frozen=True)
class Subcommand:
    module: str  # has build_parser() and cli_main(argv)
    summary: str  # one sentence, for the command's --help
    arguments: str | None = None  # "module:NAME" of an Arguments run before ``module`` is imported


@dataclass(frozen=True)
class Command:
    """A console script: a default command (``module``) and named subcommands, each its own module."""

    prog: str
    module: str
    subcommands: Mapping[str, Subcommand]
    arguments: str | None = None  # "module:NAME" of the default command's Arguments (see Subcommand)

    def epilog(self) -> str:
        """The subcommands with their summaries, for the default command's --help."""
        indent = max(len(n) for n in self.subcommands) + 4
        lines = ["subcommands:"]
        for name, sub in self.subcommands.items():
            first, *rest = textwrap.wrap(sub.summary, _help_width() - indent)
            lines += [f"  {name:<{indent - 2}}{first}", *(" " * indent + r for r in rest)]
        lines.append(f"\nRun `{self.prog} SUBCOMMAND --help` for a subcommand's options.")
        return "\n".join(lines)


def _help_width() -> int:
    return min(100, shutil.get_terminal_size().columns) - 2  # argparse's own width rule, capped


class _ParagraphsFormatter(argparse.HelpFormatter):
    """Wraps each blank-line separated paragraph of a description; keeps indented blocks (the subcommand
    list) as they are."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            block if any(line.startswith(" ") for line in block.splitlines())
            else textwrap.fill(" ".join(block.split()), width, initial_indent=indent, subsequent_indent=indent)
            for block in text.split("\n\n"))


def finite_float(text: str) -> float:
    """argparse ``type`` of every float argument: ``nan`` and ``inf`` are argument errors (exit 2), not values
    that slip past a range check (``nan < 0`` is false) into the work."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def command_parser(prog: str, *paragraphs: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose description is ``paragraphs`` (whole sentences, each wrapped to the terminal)."""
    return argparse.ArgumentParser(prog=prog, description="\n\n".join(paragraphs), epilog=epilog,
                                   formatter_class=_ParagraphsFormatter)


def dispatch(argv: Sequence[str] | None, command: Command) -> int | None:
    """Run ``<subcommand module>.cli_main(rest)`` for ``argv[0]`` in the command's subcommands, else the default
    command's ``cli_main(argv)``.

    Modules are imported on use, so ``--help`` of one subcommand does not load the others' dependencies; a
    command's :class:`Arguments`, where it names one, parse and check ``argv`` before its module is imported. A
    first argument that is neither a subcommand nor a config file (``dflash-train evl ...``) is an error that
    says so (exit 2), not the default command's complaint about its missing options.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in command.subcommands:
        sub = command.subcommands[args[0]]
        if sub.arguments:
            _arguments(sub.arguments).parse(args[1:])
        return importlib.import_module(sub.module).cli_main(args[1:])
    if not args:
        parser = (_arguments(command.arguments).build_parser() if command.arguments
                  else importlib.import_module(command.module).build_parser())
        parser.print_help(sys.stderr)
        return 2
    _refuse_unknown_subcommand(args[0], command)
    if command.arguments:
        _arguments(command.arguments).parse(args)
    return importlib.import_module(command.module).cli_main(args)


def _arguments(ref: str) -> Arguments:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _refuse_unknown_subcommand(first: str, command: Command) -> None:
    if first.startswith("-") or first.endswith(".toml") or "/" in first or Path(first).exists():
        return  # an option, or the default command's config file
    names = list(command.subcommands)
    close = difflib.get_close_matches(first, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else (
        f"expected a subcommand ({', '.join(names)}) or a config file, e.g. {command.prog} configs/tiny.toml ...")
    raise UsageError(f"unknown subcommand {first!r}; {hint} (see {command.prog} --help)")

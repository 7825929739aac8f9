"""Every command's help is complete: subcommands listed, every option and positional explained, descriptions
in whole sentences; a mistyped subcommand is named as such."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_cache.cli import build_parser as cache_parser
from dflash_cache.runtime.entry import Command
from extract.cli import COMMAND as EXTRACT
from extract.cli import main as extract_main
from train.cli import COMMAND as TRAIN
from train.cli import main as train_main

BIN = Path(sys.executable).parent


def _command_parsers(command: Command) -> dict[str, argparse.ArgumentParser]:
    parsers = {command.prog: importlib.import_module(command.module).build_parser()}
    for name, sub in command.subcommands.items():
        parsers[f"{command.prog} {name}"] = importlib.import_module(sub.module).build_parser()
    return parsers


def _walk(parser: argparse.ArgumentParser, name: str) -> dict[str, argparse.ArgumentParser]:
    """``parser`` and every parser below it (argparse subparsers)."""
    out = {name: parser}
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out.update(_walk(sub, f"{name} {sub_name}"))
    return out


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    from train.demo import build_parser as demo_parser

    out = {**_command_parsers(EXTRACT), **_command_parsers(TRAIN), **_walk(cache_parser(), "dflash-cache")}
    out["python -m train.demo"] = demo_parser()
    return out


PARSERS = _all_parsers()


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_action_has_help_and_the_description_is_whole_sentences(name):
    parser = PARSERS[name]
    text = parser.description or ""
    assert text.strip().endswith("."), f"{name}: description {text!r} is not a whole sentence"
    assert "``" not in text and "``" not in (parser.epilog or ""), f"{name}: raw reST in the help"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        what = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{name}: {what} has no help"
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help and choice.help.endswith("."), f"{name} {choice.dest}: no summary"


@pytest.mark.parametrize("command", [EXTRACT, TRAIN], ids=lambda c: c.prog)
def test_top_level_help_lists_every_subcommand_with_its_summary(command, capsys):
    parser = importlib.import_module(command.module).build_parser()
    text = parser.format_help()
    for name, sub in command.subcommands.items():
        assert f"\n  {name} " in text, f"{command.prog} --help does not list {name}"
        assert sub.summary.endswith(".") and sub.summary.split()[0] in text


def test_console_scripts_help_as_a_user_types_it():
    out = subprocess.run([str(BIN / "dflash-extract"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "estimate" in out.stdout and "regenerate" in out.stdout
    out = subprocess.run([str(BIN / "dflash-train"), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert all(f"\n  {s} " in out.stdout for s in ("estimate", "eval", "export", "report")), out.stdout


@pytest.mark.parametrize("main,argv,message", [
    (train_main, ["evl", "configs/tiny.toml", "--cache", "c"], "unknown subcommand 'evl'; did you mean 'eval'?"),
    (train_main, ["reprot", "runs/x"], "unknown subcommand 'reprot'; did you mean 'report'?"),
    (extract_main, ["regenerat", "configs/tiny.toml"], "unknown subcommand 'regenerat'; did you mean 'regenerate'?"),
    (train_main, ["frobnicate"], "unknown subcommand 'frobnicate'; expected a subcommand (estimate, eval, export, "
                                 "report) or a config file"),
])
def test_mistyped_subcommand_is_named(main, argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "required" not in err


def test_a_missing_config_file_is_still_a_config_error(capsys, tmp_path):
    # a path-like first argument is the default command's config, whatever it resembles
    assert train_main([str(tmp_path / "eval.toml"), "--cache", "c", "--run-dir", "r"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_no_arguments_prints_the_help_with_the_subcommands(capsys):
    assert train_main([]) == 2
    err = capsys.readouterr().err
    assert "usage: dflash-train" in err and "subcommands:" in err and "\n  eval " in err


ROOT = Path(__file__).resolve().parents[1]
_TORCH_FREE = """
import atexit, sys
atexit.register(lambda: print("torch imported:", "torch" in sys.modules))  # --help and argparse errors exit
from {module} import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(("module", "argv", "message"), [
    ("train.cli", ["configs/tiny.toml", "--cache", "c", "--run-dir", "r", "--set", "train.lrr=1"], "train.lrr"),
    ("train.cli", ["configs/tny.toml", "--cache", "c", "--run-dir", "r"], "configs/tny.toml does not exist"),
    ("train.cli", ["configs/tiny.toml", "--cache", "c"], "--run-dir"),
    ("train.cli", ["--help"], "usage: dflash-train"),
    ("train.demo", ["--set", "guards.rebaseline_afer=4"], "guards.rebaseline_afer"),
])
def test_arguments_and_config_are_checked_before_torch_is_imported(module, argv, message):
    # a typo costs ~5 s of CPU when torch is imported first (~90 s on a busy machine)
    proc = subprocess.run([sys.executable, "-c", _TORCH_FREE.format(module=module, argv=argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert message in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == (0 if argv == ["--help"] else 2), proc.stderr[-2000:]
    assert "torch imported: False" in proc.stdout, proc.stdout[-2000:]


def test_a_config_missing_from_the_working_directory_names_it_and_the_shipped_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train_main(["configs/tiny.toml", "--cache", "c", "--run-dir", "r"]) == 2
    err = capsys.readouterr().err
    assert f"relative to the working directory {tmp_path}" in err and str(ROOT / "configs" / "tiny.toml") in err

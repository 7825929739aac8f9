"""Every command's help is complete: subcommands listed, every option and positional explained, descriptions
in whole sentences; a mistyped subcommand is named as such."""

from __future__ import annotations

import argparse
import importlib
import json
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
# every console script (and the demo) with each subcommand: the mistakes a user makes, each answered before
# torch is imported (~5 s of CPU, ~90 s on a busy machine); one child per script runs its cases in order and
# records after each whether torch is in sys.modules
_CHILD = """
import contextlib, io, json, sys
from {module} import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(argv)
        except SystemExit as exit:  # --help and argparse's errors
            rc = exit.code
    results.append({{"argv": argv, "rc": rc, "out": out.getvalue(), "torch": "torch" in sys.modules}})
print(json.dumps(results))
"""

_TINY, _NO_CONFIG = "configs/tiny.toml", "configs/tny.toml"
_MISSING = "configs/tny.toml does not exist"
_CASES = {
    "train.cli": [  # dflash-train
        ([], 2, "usage: dflash-train"),
        (["--help"], 0, "usage: dflash-train"),
        ([_TINY, "--cache", "c", "--run-dir", "r", "--set", "train.lrr=1"], 2, "train.lrr"),
        ([_NO_CONFIG, "--cache", "c", "--run-dir", "r"], 2, _MISSING),
        ([_TINY, "--cache", "c"], 2, "--run-dir"),
        ([_TINY, "--cache", "c", "--run-dir", "r", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["evl", _TINY], 2, "did you mean 'eval'?"),
        (["eval", "--help"], 0, "usage: dflash-train eval"),
        (["eval", _TINY, "--cache", "c", "--checkpoint", "k", "--set", "eval.max_blocs=3"], 2, "eval.max_blocs"),
        (["eval", _NO_CONFIG, "--cache", "c", "--checkpoint", "k"], 2, _MISSING),
        (["eval", _TINY, "--cache", "c", "--checkpoint", "k", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["export", "--help"], 0, "usage: dflash-train export"),
        (["export", "r", "--out", "o", "--dtype", "fp8"], 2, "invalid choice: 'fp8'"),
        (["export", "r", "--out", "o", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["report", "--help"], 0, "usage: dflash-train report"),
        (["report", "r", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["estimate", "--help"], 0, "usage: dflash-train estimate"),
        (["estimate", _TINY, "--set", "model.n_layer=2"], 2, "model.n_layer"),
        (["estimate", _NO_CONFIG], 2, _MISSING),
        (["estimate", _TINY, "--bogus"], 2, "unrecognized arguments: --bogus"),
    ],
    "extract.cli": [  # dflash-extract
        ([], 2, "usage: dflash-extract"),
        (["--help"], 0, "usage: dflash-extract"),
        ([_TINY, "--out", "o", "--set", "data.pth=x"], 2, "data.pth"),
        ([_NO_CONFIG, "--out", "o"], 2, _MISSING),
        ([_TINY, "--out", "o", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["estimate", "--help"], 0, "usage: dflash-extract estimate"),
        (["estimate", _TINY, "--set", "cache.codek=x"], 2, "cache.codek"),
        (["estimate", _NO_CONFIG], 2, _MISSING),
        (["estimate", _TINY, "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["regenerate", "--help"], 0, "usage: dflash-extract regenerate"),
        (["regenerate", _TINY, "--out", "o", "--set", "regenerate.max_new_tokenz=4"], 2,
         "regenerate.max_new_tokenz"),
        (["regenerate", _NO_CONFIG, "--out", "o"], 2, _MISSING),
        (["regenerate", _TINY, "--out", "o", "--bogus"], 2, "unrecognized arguments: --bogus"),
    ],
    "dflash_cache.cli": [  # dflash-cache (no config; opening a cache is the work)
        (["--help"], 0, "usage: dflash-cache"),
        *[([sub, "--help"], 0, f"usage: dflash-cache {sub}") for sub in ("info", "verify", "gc", "release")],
        (["info", "c", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["release", "c"], 2, "--host"),
        (["infoo", "c"], 2, "invalid choice: 'infoo'"),
    ],
    "train.demo": [  # python -m train.demo (make demo)
        (["--help"], 0, "usage: python -m train.demo"),
        (["--set", "guards.rebaseline_afer=4"], 2, "guards.rebaseline_afer"),
        (["--config", _NO_CONFIG], 2, _MISSING),
        (["--bogus"], 2, "unrecognized arguments: --bogus"),
    ],
}


@pytest.mark.parametrize("module", sorted(_CASES))
def test_arguments_and_config_are_checked_before_torch_is_imported(module):
    # a typo costs ~5 s of CPU when torch is imported first (~90 s on a busy machine)
    cases = _CASES[module]
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(module=module), json.dumps([a for a, _, _ in cases])],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert len(results) == len(cases)
    for (argv, rc, message), got in zip(cases, results, strict=True):
        assert message in got["out"], (argv, got["out"][-2000:])
        assert got["rc"] == rc, (argv, got["rc"], got["out"][-2000:])
        assert not got["torch"], f"{module} {argv} imported torch before answering"



def test_a_config_missing_from_the_working_directory_names_it_and_the_shipped_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train_main(["configs/tiny.toml", "--cache", "c", "--run-dir", "r"]) == 2
    err = capsys.readouterr().err
    assert f"relative to the working directory {tmp_path}" in err and str(ROOT / "configs" / "tiny.toml") in err


def test_the_export_parser_offers_exactly_the_dtypes_export_writes():
    from train.cli_args import EXPORT_DTYPES
    from train.tools.export import _DTYPES

    assert sorted(EXPORT_DTYPES) == sorted(_DTYPES)

"""nan and inf are argument errors everywhere: every float option of every command, the sampling parameters of
the library, and every float field of the config (``--set``), each refused with exit 2 naming what to fix
before any work (``nan`` passes every range check written as ``x < 0``; ``inf`` made ``eval --live`` report a
meaningless "lossless" tau)."""

from __future__ import annotations

import math

import pytest

from dflash_cache.cli import main as cache_main
from dflash_cache.errors import ConfigError
from dflash_cache.runtime.config import load_config
from extract.cli import main as extract_main
from train.cli import main as train_main
from train.tools.sampling import SamplingParams

TINY = "configs/tiny.toml"
EVAL = ["eval", TINY, "--cache", "no-cache", "--checkpoint", "no-run", "--live"]

# (command, argv before the option, option): every float option of every command
FLOAT_OPTIONS = [
    (train_main, EVAL, "--temperature"),
    (train_main, [*EVAL, "--temperature", "1"], "--top-p"),
    (train_main, ["report", "no-run"], "--z"),
    (train_main, ["estimate", TINY], "--gpu-memory"),
    (train_main, ["estimate", TINY], "--tokens-per-s"),
    (train_main, ["estimate", TINY], "--gpu-tflops"),
    (train_main, ["estimate", TINY], "--mfu"),
    (extract_main, ["estimate", TINY], "--tokens-per-s"),
    (cache_main, ["gc", "no-cache"], "--min-age"),
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
@pytest.mark.parametrize(("main", "argv", "option"), FLOAT_OPTIONS,
                         ids=[f"{a[0]}{o}" for _, a, o in FLOAT_OPTIONS])
def test_a_non_finite_float_option_is_an_argument_error(monkeypatch, capsys, main, argv, option, value):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    with pytest.raises(SystemExit) as exit_:
        main([*argv, f"{option}={value}"])  # (the = form: argparse reads a bare -inf as an option)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert f"argument {option}: {value!r} is not a finite number" in err.strip().splitlines()[-1], err


def test_a_finite_value_still_parses(monkeypatch, capsys):
    """The same options take ordinary numbers (the refusal above is about the value, not the option)."""
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    assert cache_main(["gc", "no-such-cache", "--min-age", "1e3"]) == 2  # parsed; the cache is what is missing
    assert "is not a finite number" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_decode_rate_is_refused(monkeypatch, capsys, value):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    assert extract_main(["estimate", TINY, "--decode-gbps", f"bf16-zstd={value}"]) == 2
    assert f"--decode-gbps 'bf16-zstd={value}': expected CODEC=GBPS" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [dict(temperature=math.nan), dict(temperature=math.inf),
                                 dict(temperature=1.0, top_p=math.nan), dict(temperature=1.0, top_p=math.inf)])
def test_sampling_params_refuse_non_finite_values(bad):
    """The library's own check (callers other than the command line): nan passed ``temperature < 0``."""
    with pytest.raises(ConfigError, match="must be a finite number"):
        SamplingParams(**bad)


@pytest.mark.parametrize("field", ["model.rms_norm_eps", "model.rope_theta", "train.collective_timeout_s",
                                   "train.lr"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_config_value_is_refused_naming_the_field(monkeypatch, field, value):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    with pytest.raises(ConfigError, match=rf"{field}: Input should be a finite number"):
        load_config(TINY, [f"{field}={value}"])

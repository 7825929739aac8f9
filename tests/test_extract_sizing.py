"""``dflash-extract estimate``'s sizing lines: bytes per codec with and without the final hidden state,
the read bandwidth at a given training speed and the reader cores at a given decode rate, checked
against the arithmetic from the counted tokens."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from extract.cli import main
from extract.estimate import CODEC_RATIO, SMALL_BYTES_PER_TOKEN
from extract.progress import human_bytes

ROOT = Path(__file__).resolve().parents[1]


def _estimate(capsys, *extra: str) -> str:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["estimate", "configs/tiny.toml", "--data", "builtin:tiny-chat?n=24", *extra]) == 0
    finally:
        os.chdir(cwd)
    return capsys.readouterr().out


def test_sizing_lines_follow_the_counted_tokens(capsys):
    out = _estimate(capsys, "--tokens-per-s", "1000000", "--decode-gbps", "bf16-zstd=0.5")
    tokens = int(re.search(r"kept \d+ samples, (\d+) tokens", out).group(1))
    layers = len(re.search(r"layers \[([\d, ]+)\]", out).group(1).split(","))
    hidden = int(re.search(r"x hidden (\d+)", out).group(1))
    for codec, ratio in CODEC_RATIO.items():
        def stored(n_layers: int, codec: str = codec, ratio: float = ratio) -> int:
            scales = tokens * n_layers * 4 if codec == "fp8-e4m3" else 0
            return int(tokens * n_layers * hidden * 2 * ratio + scales + tokens * SMALL_BYTES_PER_TOKEN)

        line = next(ln for ln in out.splitlines() if ln.strip().startswith(codec + " "))
        without, with_final = stored(layers), stored(layers + 1)
        assert f"{human_bytes(without)} / " in line and f"{human_bytes(with_final)}   read" in line, line
        assert f"read {human_bytes(1e6 * without / tokens)}/s / {human_bytes(1e6 * with_final / tokens)}/s" in line
    zstd = next(ln for ln in out.splitlines() if ln.strip().startswith("bf16-zstd "))
    cores = 1e6 * layers * hidden * 2 / 0.5e9
    assert f"reader cores {cores:.3g} / {cores * (layers + 1) / layers:.3g}" in zstd, zstd
    assert "<- configured" in zstd


def test_a_bad_decode_rate_is_a_usage_error(capsys):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["estimate", "configs/tiny.toml", "--data", "builtin:tiny-chat?n=4", "--decode-gbps",
                     "zstd=fast"]) == 2
    finally:
        os.chdir(cwd)
    assert "--decode-gbps 'zstd=fast': expected CODEC=GBPS" in capsys.readouterr().err


@pytest.mark.parametrize("codec", sorted(CODEC_RATIO))
def test_every_codec_has_a_decode_rate(codec):
    from extract.estimate import DECODE_GBPS_PER_CORE

    assert DECODE_GBPS_PER_CORE[codec] > 0

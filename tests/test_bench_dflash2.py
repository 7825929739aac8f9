"""bench/bench_dflash2.py runs against the current API at one round (its figures come from longer runs)."""

from __future__ import annotations

import json

from test_bench_scripts import _run


def test_bench_dflash2_times_both_families_and_compares_the_27b_estimates(monkeypatch, tmp_path):
    out = tmp_path / "dflash2.json"
    _run(monkeypatch, "bench_dflash2", "--rounds", "1", "--steps", "1", "--drafts", "1", "--out", str(out))
    r = json.loads(out.read_text())
    for key in ("train_step_s", "draft_block_s"):
        assert set(r[key]) == {"dflash", "dflash2"} and all(v["median"] > 0 for v in r[key].values())
    assert r["dflash2_over_dflash"]["train_step"]["median"] > 0
    peaks = r["estimate_27b_presets"]
    assert peaks["qwen3.6-27b-dflash2"]["fits_96_gib"] and peaks["qwen3.6-27b"]["fits_96_gib"]
    assert peaks["qwen3.6-27b-dflash2"]["peak_gib"] > peaks["qwen3.6-27b"]["peak_gib"]

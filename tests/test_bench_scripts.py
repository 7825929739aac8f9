"""The benchmark scripts run against the current API at tiny shapes (so that they never rot between the runs
that produce their figures), and their built-in agreement checks hold."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(monkeypatch, name: str, *argv: str):
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    return _bench(name).main()


def test_bench_loss_heads_and_steps_agree(monkeypatch, tmp_path):
    out = tmp_path / "loss.json"
    _run(monkeypatch, "bench_loss", "--rows", "512", "--hidden", "32", "--vocab", "2000", "--chunks", "64",
         "--dtypes", "float32", "--repeats", "1", "--layers", "1", "--docs", "2", "--doc-len", "64",
         "--anchors", "8", "--step-chunk", "64", "--out", str(out))
    r = json.loads(out.read_text())
    head = r["head_float32"]
    assert head["agreement"]["chunked_64"]["loss_rel_diff"] <= 1e-6
    assert head["agreement"]["chunked_64"]["grad_max_abs_diff_over_max"] <= 1e-5
    assert head["agreement"]["chunked_64"]["pred_mismatch_fraction"] == 0.0
    # 8 chunks of rows: the unchunked head holds ~3 copies of all the logits, the chunked one an eighth of one
    assert head["peak_bytes"]["unchunked"] >= 2 * head["one_copy_of_all_logits_bytes"]
    assert head["memory_ratio_unchunked_over_chunked"]["chunked_64"] >= 8
    step = r["step"]
    assert step["agreement"]["metrics_equal"] and step["agreement"]["loss_rel_diff"] <= 1e-6
    assert step["agreement"]["grad_max_abs_diff_over_max"] <= 1e-5
    assert step["shape"]["blocks"] == 2 * 8 and len(step["cpu_s"]["unchunked"]) == 4


def test_bench_drafter_runs_the_27b_code_path_on_cpu(monkeypatch, tmp_path):
    out = tmp_path / "drafter.json"
    _run(monkeypatch, "bench_drafter", "--gpu-path-on-cpu", "--steps", "1", "--out", str(out))
    r = json.loads(out.read_text())["cpu_27b_path_check"]
    assert r["layer_types"].count("sliding_attention") == 4 and r["activation_checkpointing"] is True
    assert r["blocks"] == 64 and r["block_rows_per_step"] == 64 * 16
    assert abs(r["loss"] - math.log(r["vocab"])) < 1.0  # random drafter: about uniform over the vocabulary
    assert 0 < r["mask_fraction"]["median"] < 1


def test_bench_specforge_without_specforge_says_skipped_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "specforge", None)  # import specforge -> ImportError
    out = tmp_path / "sf.json"
    assert _run(monkeypatch, "bench_specforge", "--out", str(out)) == 0
    assert "skipped: specforge is not importable" in capsys.readouterr().out
    assert not out.exists()


def test_bench_eval_threads_compares_default_threads_with_the_budget(monkeypatch, tmp_path):
    out = tmp_path / "eval_threads.json"
    _run(monkeypatch, "bench_eval_threads", "--rounds", "1", "--samples", "16", "--steps", "1", "--prompts", "1",
         "--new-tokens", "4", "--out", str(out))
    r = json.loads(out.read_text())
    assert len(r["runs"]["default"]) == len(r["runs"]["budget"]) == 1
    assert r["runs"]["default"][0]["threads"] == r["torch_default_threads"]
    assert 1 <= r["budget_threads"] <= r["torch_default_threads"]
    assert r["cpu_ratio_default_over_budget"] > 0 and r["wall_ratio_default_over_budget"] > 0


def test_bench_http_client_measures_both_transports(monkeypatch, tmp_path, capsys):
    out = tmp_path / "http.json"
    assert _run(monkeypatch, "bench_http_client", "--rounds", "1", "--requests", "20", "--out", str(out)) == 0
    if "skipped: httpx is not importable" in capsys.readouterr().out:
        assert not out.exists()
        return
    r = json.loads(out.read_text())
    for name in ("stdlib", "httpx"):
        assert r[name]["cpu_ms_per_request"]["median"] > 0 and r[name]["rps_8_in_flight_50ms"]["median"] > 0


def test_bench_decode_rates_measures_every_codec(monkeypatch, tmp_path):
    out = tmp_path / "rates.json"
    _run(monkeypatch, "bench_decode_rates", "--tokens", "3000", "--hidden", "64", "--rounds", "1",
         "--workdir", str(tmp_path / "w"), "--out", str(out))
    res = json.loads(out.read_text())
    assert set(res["codecs"]) == {"bf16-raw", "bf16-zstd", "bf16-lz4", "fp8-e4m3"}
    for codec, row in res["codecs"].items():
        assert row["gb_per_cpu_s_median"] > 0, codec
    assert res["codecs"]["fp8-e4m3"]["stored_over_raw"] < 0.6  # one byte per value plus scales


def test_bench_object_store_runs_every_store_and_reports_requests(monkeypatch, tmp_path):
    out = tmp_path / "object_store.json"
    _run(monkeypatch, "bench_object_store", "--samples", "24", "--hidden", "32", "--median-length", "64",
         "--samples-per-part", "12", "--rounds", "2", "--locality-parts", "1", "--epochs", "2",
         "--workdir", str(tmp_path / "w"), "--out", str(out))  # (with the loopback S3 server where moto is installed)
    res = json.loads(out.read_text())
    stores = res["stores"]
    assert {"local", "latency-0ms", "latency-20ms"} <= set(stores)
    assert stores["local"]["vs_local"] == 1.0 and stores["local"]["requests_per_sample"] is None
    # the order rotates: the store that ran first in round 0 runs last in round 1, the second runs first
    first = [min(stores, key=lambda n: stores[n]["rounds"][r]["position"]) for r in (0, 1)]
    assert first[0] == "local" and first[1] != "local"
    assert stores[first[1]]["rounds"][0]["position"] == 1 and stores["local"]["rounds"][1]["position"] == len(stores) - 1
    # the ratio to local is each round's own ratio (median of two rounds: their mean), not a ratio of medians
    for name in set(stores) - {"local"}:
        per_round = [stores[name]["rounds"][r]["tokens_per_s"] / stores["local"]["rounds"][r]["tokens_per_s"]
                     for r in (0, 1)]
        assert stores[name]["vs_local_per_round"] == pytest.approx(per_round)
        assert stores[name]["vs_local"] == pytest.approx(sum(per_round) / 2)
        assert stores[name]["vs_local_range"] == pytest.approx([min(per_round), max(per_round)])
    for name in set(stores) - {"local"}:
        assert stores[name]["tokens_per_s_median"] > 0 and 0 < stores[name]["requests_per_sample"] < 1
        assert stores[name]["rounds"][1]["samples"] == 2 * 24  # every sample of both epochs, from every store
        assert stores[name]["later_epochs_tokens_per_s_median"] > 0 and stores[name]["later_epochs_vs_local"] > 0
        kinds = stores[name]["requests_by_kind"]  # every request the loader's cache made, by kind
        assert kinds["feature range"] >= 1 and kinds["commit record"] >= 1 and kinds["small array"] >= 1, kinds
        assert stores[name]["all_requests_per_sample"] > stores[name]["requests_per_sample"]

"""bench/build_sharegpt_teacher.py and bench/bench_recipe_real.py: the ShareGPT teacher fixture and the recipe
release check run against the current API at tiny sizes (their figures come from the full runs)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys

import pytest
import torch
from test_bench_scripts import ROOT, _bench, _run

from dflash_cache.errors import DataError

sys.path.insert(0, str(ROOT / "bench"))  # as bench_recipe_real.py imports it: a module registered by name
import build_sharegpt_teacher as sgt  # noqa: E402


def _record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_json_array_stream_reads_every_complete_record_of_a_truncated_array(tmp_path):
    records = [_record(f"r{i}", ("human", "hi [x] {y}" * i), ("gpt", "ok")) for i in range(5)]
    text = json.dumps(records, indent=1)
    cut = text[: text.rindex('"r4"') + 2]  # inside the last record
    path = tmp_path / "a.json"
    path.write_text(cut)
    assert [r["id"] for r in sgt.iter_json_array(path)] == ["r0", "r1", "r2", "r3"]
    path.write_text(text)
    assert [r["id"] for r in sgt.iter_json_array(path)] == [f"r{i}" for i in range(5)]
    path.write_text(text.replace('"r2"', '"r2" oops'))  # broken in the middle: an error, not an early end
    with pytest.raises(DataError, match="malformed JSON"):
        list(sgt.iter_json_array(path))


def test_sharegpt_roles_leading_assistant_turns_and_cut_turns():
    conv = sgt.conversation(_record("a", ("gpt", "tail of a split"), ("system", "be brief"), ("human", "q" * 50),
                                    ("chatgpt", "a1"), ("user", "q2"), ("bard", "a2")), max_chars=10)
    # a system turn after the dropped assistant piece comes first; roles as the chat template names them
    assert conv == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q" * 10},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": "a2"}]
    assert sgt.conversation(_record("b", ("gpt", "only the assistant")), 100) is None
    assert sgt.conversation({"id": "c", "conversations": []}, 100) is None
    # an empty turn ends the conversation there
    assert sgt.conversation(_record("d", ("human", "q"), ("gpt", ""), ("human", "q3")), 100) == [
        {"role": "user", "content": "q"}]


def test_heldout_split_is_the_id_hash_rule():
    ids = [f"id{i}" for i in range(2000)]
    want = [i for i in ids if int(hashlib.sha256(i.encode()).hexdigest()[:8], 16) % 50 == 0]
    assert [i for i in ids if sgt.is_heldout(i)] == want
    assert 20 <= len(want) <= 60


def test_teacher_builds_once_per_recipe_with_the_tiny_chat_rules(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from extract.tiny import CHAT_TEMPLATE

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    torch.set_num_threads(1)
    recipe = sgt.Recipe(steps=2, batch_size=2, seq_len=16, tokenizer_conversations=20, tokenizer_vocab=300,
                        warmup_steps=1, num_hidden_layers=2, hidden_size=32, head_dim=8, intermediate_size=64)
    path = sgt.resolve_sharegpt_teacher(recipe)
    assert path == tmp_path / f"sharegpt-teacher-{recipe.key()}"
    info = json.loads((path / "build.json").read_text())
    assert info["tokens_trained"] == 2 * 2 * 16 and info["recipe"]["seed"] == 0
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.mask_token == "<|mask|>" and tok.eos_token == "<|im_end|>" and tok.chat_template == CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == len(tok) <= 300
    mtime = os.stat(path / "build.json").st_mtime_ns
    assert sgt.resolve_sharegpt_teacher(recipe) == path and os.stat(path / "build.json").st_mtime_ns == mtime
    assert sgt.teacher_dir(sgt.Recipe(steps=3)) != sgt.teacher_dir(sgt.Recipe(steps=2))

    # held-out perplexity: against the model's own loss (transformers' shifted CE) on one short conversation
    conv = [{"role": "user", "content": "What is a river?"}, {"role": "assistant", "content": "Water that flows."}]
    stats = sgt.language_stats(path, [conv])
    text = tok.apply_chat_template(conv, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    assert stats["tokens"] == ids.shape[1] - 1
    assert stats["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)
    assert stats["bits_per_byte"] == pytest.approx(loss * (ids.shape[1] - 1) / math.log(2) / len(text.encode()), rel=1e-4)
    assert 0 < stats["mean_entropy_nats"] <= stats["max_entropy_nats"] == pytest.approx(math.log(model.config.vocab_size))


def test_position_acceptance_counts_cycles_that_kept_k_drafts():
    brr = _bench("bench_recipe_real")
    # cycles keep 0, 2 and 7 drafts (counts include the teacher's token)
    assert brr.position_acceptance([1, 3, 8], 8) == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])


def test_bench_recipe_real_short_variant_on_the_tiny_teacher(monkeypatch, tmp_path, capsys):
    out = tmp_path / "out.json"
    argv = ["--teacher", "tiny", "--train-prompts", "12", "--heldout-prompts", "1", "--humaneval", "1", "--steps", "2",
            "--seeds", "2", "--jobs", "1", "--arms", "untrained", "base", "tv", "--max-new-tokens", "12",
            "--live-new-tokens", "4", "--prompt-chars", "120", "--workdir", str(tmp_path / "w"), "--out", str(out)]
    _run(monkeypatch, "bench_recipe_real", *argv)
    assert "0 run(s) reused" in capsys.readouterr().out
    res = json.loads(out.read_text())
    # a second call reuses every finished run (an interrupted grid resumes), with the same figures
    _run(monkeypatch, "bench_recipe_real", *argv)
    assert "6 run(s) reused" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"] == res["runs"]
    # a grid cut short: report what finished, name what did not, run nothing
    _run(monkeypatch, "bench_recipe_real", *argv, "--seeds", "3", "--arms", "base", "dflash2", "--finished-only")
    assert "not run: base-seed3, dflash2-seed1, dflash2-seed2, dflash2-seed3" in capsys.readouterr().out
    cut = json.loads(out.read_text())
    assert cut["seeds_run"] == {"base": [1, 2]} and cut["runs"]["base"] == res["runs"]["base"]
    assert res["prompts"] == {"sharegpt_heldout": 1, "humaneval": 1} and res["seeds"] == [1, 2]
    runs = res["runs"]
    assert [r["seed"] for r in runs["base"]] == [1, 2] and all(r["steps"] == 2 for r in runs["base"] + runs["tv"])
    assert all("steps" not in r for r in runs["untrained"])
    keys = {"sharegpt_heldout/greedy", "sharegpt_heldout/T=1", "humaneval/greedy", "humaneval/T=1"}
    for r in runs["base"] + runs["tv"] + runs["untrained"]:
        assert set(r["live"]) == keys
        for v in r["live"].values():
            assert v["tau"] == pytest.approx(sum(v["tau_per_prompt"]) / len(v["tau_per_prompt"])) and v["tau"] >= 1
            acc = v["position_acceptance"]
            assert len(acc) == 7 and all(0 <= a <= 1 for a in acc) and acc == sorted(acc, reverse=True)
    # the paired differences, recomputed from the runs
    diff = res["summary"]["tv"]["minus_base"]["live_tau/humaneval/T=1"]
    d = [t["live"]["humaneval/T=1"]["tau"] - b["live"]["humaneval/T=1"]["tau"] for t, b in zip(runs["tv"], runs["base"], strict=True)]
    assert (diff["min"], diff["max"]) == pytest.approx((min(d), max(d)))
    assert "bonus" in res["tau_convention"] or "teacher's own token" in res["tau_convention"]

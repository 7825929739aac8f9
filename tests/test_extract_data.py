"""Data loading, chat templating, assistant-only loss masks and bad-input handling."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dflash_cache.errors import ConfigError, DataError
from extract.data import load_records
from extract.template import TemplateOptions, prepare_samples, tokenize_conversation

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Explain rivers."},
    {"role": "assistant", "content": "Sure. rivers move."},
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "Because water flows."},
]


@pytest.fixture(scope="module")
def tok(tiny_teacher_dir):
    return AutoTokenizer.from_pretrained(tiny_teacher_dir)


def _masked_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_loss_mask_covers_assistant_turns_only_on_qwen3_style_template(tok):
    # history turn 2 renders WITHOUT a think block, the final turn WITH one: prefixes are not prefixes
    ids, mask = tokenize_conversation(tok, CONV, TemplateOptions())
    full = tok.apply_chat_template(CONV, tokenize=False)
    assert ids == tok(full, add_special_tokens=False)["input_ids"]
    assert _masked_text(tok, ids, mask) == (
        "Sure. rivers move.<|im_end|><think>\n\n</think>\n\nBecause water flows.<|im_end|>")
    # nothing of the system/user turns or the assistant headers is in the mask
    unmasked = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "Explain rivers." in unmasked and "Why?" in unmasked and "Sure" not in unmasked


def test_enable_thinking_false_masks_only_the_answer(tok):
    ids, mask = tokenize_conversation(tok, CONV[:3], TemplateOptions(enable_thinking=False))
    # the empty think block belongs to the generation prompt, not to the assistant's tokens
    assert _masked_text(tok, ids, mask) == "Sure. rivers move.<|im_end|>"


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_malformed_json_line_names_file_and_line_and_skip_bad_counts(tmp_path):
    good = json.dumps({"messages": CONV[1:3]})
    path = _write(tmp_path / "d.jsonl", [good, "{not json", good])
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON"):
        load_records(path)
    loaded = load_records(path, skip_bad=True)
    assert [r.sample_id for r in loaded.records] == [0, 2]  # ids stay stable around the bad line
    assert loaded.n_total == 3 and len(loaded.bad) == 1 and "d.jsonl:2" in loaded.bad[0]


def test_unknown_role_and_empty_file(tmp_path):
    path = _write(tmp_path / "r.jsonl", [json.dumps({"messages": [{"role": "wizard", "content": "x"}]})])
    with pytest.raises(DataError, match=r"r\.jsonl:1: .*unknown role 'wizard'"):
        load_records(path)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no records found"):
        load_records(str(empty))


def test_no_assistant_turn_is_an_error_or_a_counted_skip(tmp_path, tok):
    path = _write(tmp_path / "n.jsonl", [json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                                         json.dumps({"messages": CONV[1:3]})])
    records = load_records(path).records
    with pytest.raises(DataError, match=r"n\.jsonl:1: conversation has no assistant turn"):
        prepare_samples(records, tok, TemplateOptions(), 512, 1)
    kept, stats = prepare_samples(records, tok, TemplateOptions(), 512, 1, skip_bad=True)
    assert [s.sample_id for s in kept] == [1] and stats.n_bad == 1


def test_tokenizer_without_chat_template(tok):
    from extract.template import check_chat_template

    class NoTemplate:
        chat_template = None

    with pytest.raises(ConfigError, match="no chat template"):
        check_chat_template(NoTemplate())
    check_chat_template(tok)


def test_truncation_and_min_loss_tokens_are_counted(tmp_path, tok):
    long_answer = " ".join(["rivers"] * 80)
    path = _write(tmp_path / "t.jsonl", [
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": long_answer}]}),
        json.dumps({"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "ok"}]}),
    ])
    kept, stats = prepare_samples(load_records(path).records, tok, TemplateOptions(), max_length=40,
                                  min_loss_tokens=12)
    assert stats.n_truncated == 1 and stats.n_too_few_loss == 1
    assert [s.sample_id for s in kept] == [0] and kept[0].length == 40 and kept[0].truncated


def test_parquet_and_pretokenized_records(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"messages": CONV[1:3]}, {"messages": CONV}]), tmp_path / "d.parquet")
    loaded = load_records(str(tmp_path / "d.parquet"))
    assert [len(r.messages) for r in loaded.records] == [2, 5]
    path = _write(tmp_path / "p.jsonl", [json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}),
                                         json.dumps({"input_ids": [5, 6], "loss_mask": [1]})])
    with pytest.raises(DataError, match=r"p\.jsonl:2: input_ids has 2 tokens but loss_mask has 1"):
        load_records(path)
    rec = load_records(path, skip_bad=True).records[0]
    assert rec.pretokenized and rec.input_ids == [5, 6, 7]


def test_builtin_set_is_deterministic():
    a, b = load_records("builtin:tiny-chat"), load_records("builtin:tiny-chat")
    assert a.fingerprint == b.fingerprint and len(a.records) == 320
    assert len({r.messages[-1]["content"] for r in a.records}) > 300
    assert len(load_records("builtin:tiny-chat?n=10").records) == 10


def test_saved_hf_dataset_through_load_from_disk(tmp_path, tiny_teacher_dir, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": CONV[1:3]}, {"messages": CONV}, {"messages": [{"role": "wizard", "content": "x"}]}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "no-train"))

    # the last row is bad: an error naming the dataset and its row, or a counted skip
    loaded = load_records(str(tmp_path / "ds"), skip_bad=True)
    assert [len(r.messages) for r in loaded.records] == [2, 5] and loaded.n_total == 3
    assert [r.source for r in loaded.records] == [f"{tmp_path / 'ds'}#0", f"{tmp_path / 'ds'}#1"]
    with pytest.raises(DataError, match=rf"{tmp_path / 'ds'}#2: .*unknown role 'wizard'"):
        load_records(str(tmp_path / "ds"))
    from_dict = load_records(str(tmp_path / "dd"), skip_bad=True)  # a DatasetDict: its train split
    assert [r.messages for r in from_dict.records] == [r.messages for r in loaded.records]
    with pytest.raises(DataError, match=r"without a 'train' split \(found \['test'\]\)"):
        load_records(str(tmp_path / "no-train"))
    # the fingerprint follows the content
    datasets.Dataset.from_list(rows[:2]).save_to_disk(str(tmp_path / "ds2"))
    assert load_records(str(tmp_path / "ds2")).fingerprint != loaded.fingerprint

    # through the real entry point
    from extract.cli import main

    args = [str(CONFIG), "--set", f"teacher.path={tiny_teacher_dir}", "--set", "data.skip_bad=true",
            "--set", "data.min_loss_tokens=1", "--data", str(tmp_path / "ds")]
    assert main(["estimate", *args]) == 0
    assert "kept 2 samples" in capsys.readouterr().out

    # without the datasets package: what to install
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"saved Hugging Face dataset .*pip install datasets"):
        load_records(str(tmp_path / "ds"))

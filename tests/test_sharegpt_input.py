"""ShareGPT as users have it, through the real commands: a JSON array file read as a stream (by content, not by
name), a truncated array, and ShareGPT's quirks (assistant-first pieces of split conversations, system turns,
other speaker names, empty conversations, non-string values, ...), each an error naming ``file#record`` or,
with ``--skip-bad``, a skip counted by reason. Never a traceback."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_cache import open_cache
from extract.cli import main

ROOT = Path(__file__).resolve().parents[1]
Q, A = "Explain rivers, please.", "Rivers move water downhill to the sea. " * 2


def _turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


GOOD = {"id": "g_0", "conversations": [_turn("human", Q), _turn("gpt", A)]}
# a later piece of a split conversation: starts with the assistant (dropped, counted), other speaker names
SPLIT = {"id": "g_1", "conversations": [_turn("gpt", "...and so on."), _turn("gpt", "More."), _turn("user", "Why?"),
                                        _turn("chatgpt", "Gravity. " * 3), _turn("human", "More?"),
                                        _turn("bard", "Tides. " * 3)]}
SYSTEM = {"id": "g_2", "conversations": [_turn("system", "Be brief."), _turn("human", "Qué es un río?"),
                                         _turn("bing", "Agua que fluye. " * 3)]}
ENDS_WITH_USER = {"id": "g_3", "conversations": [_turn("human", Q), _turn("gpt", A), _turn("human", "And lakes?")]}
# every kind of bad record, with the reason it is counted under
BAD = {
    "empty conversation": {"id": "b_0", "conversations": []},
    "non-string value": {"id": "b_1", "conversations": [_turn("human", Q), {"from": "gpt", "value": ["a", "b"]}]},
    "missing value": {"id": "b_2", "conversations": [_turn("human", Q), {"from": "gpt"}]},
    "unknown role": {"id": "b_3", "conversations": [_turn("wizard", Q), _turn("gpt", A)]},
    "no user turn": {"id": "b_4", "conversations": [_turn("gpt", A)]},
    "turns do not alternate": {"id": "b_5", "conversations": [_turn("human", Q), _turn("human", Q), _turn("gpt", A)]},
    "not an object": ["human", Q],
}
MESSAGE = {  # what the error says about each
    "empty conversation": "empty conversation (no turns)",
    "non-string value": "turn 1 (gpt) has a value of type list, expected a string",
    "missing value": "turn 1 (gpt) has no 'value'",
    "unknown role": "turn 0 has unknown speaker 'wizard'",
    "no user turn": "no user turn",
    "turns do not alternate": "turn 1 is 'user' where 'assistant' was expected",
    "not an object": "expected a JSON object, found list",
}


def _array(path: Path, records: list, indent: int | None = 2) -> Path:
    path.write_text(json.dumps(records, indent=indent, ensure_ascii=False), encoding="utf-8")
    return path


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _base(teacher: Path, *extra: str) -> list[str]:
    return ["configs/tiny.toml", "--set", f"teacher.path={teacher}", "--set", "data.min_loss_tokens=2", *extra]


def _run(*args: str) -> int:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main(list(args))
    finally:
        os.chdir(cwd)


def _estimate(teacher: Path, data: Path, capsys, *extra: str) -> tuple[int, str, str]:
    rc = _run("estimate", *_base(teacher), "--data", str(data), *extra)
    out, err = capsys.readouterr()
    return rc, out, err


def _extract(teacher: Path, data: Path, out: Path, capsys, *extra: str) -> tuple[int, str, str]:
    rc = _run(*_base(teacher, "--set", "extract.unit_size=2"), "--out", str(out), "--data", str(data), "--no-progress",
              *extra)
    stdout, err = capsys.readouterr()
    return rc, stdout, err


GOOD_SET = [GOOD, SPLIT, SYSTEM, ENDS_WITH_USER]


def test_a_json_array_is_read_like_jsonl_whatever_the_file_is_named(tiny_teacher_dir, tmp_path, capsys):
    # the array in a .jsonl file and the lines in a .json file: the content decides
    array = _array(tmp_path / "sharegpt.jsonl", GOOD_SET * 3)
    lines = _jsonl(tmp_path / "lines.json", GOOD_SET * 3)
    rc, by_array, err = _estimate(tiny_teacher_dir, array, capsys)
    assert rc == 0, err
    assert _estimate(tiny_teacher_dir, lines, capsys)[1] == by_array
    # 12 records, all used; SPLIT has two assistant turns before its first user turn, dropped (3 copies)
    assert "records read: 12, used 12, skipped 0; 6 turns before the first user turn dropped from 3 records" in by_array
    assert "kept 12 samples" in by_array and "truncated to max_length: 0" in by_array


def test_the_turns_kept_are_the_ones_the_peers_keep(tiny_teacher_dir, tmp_path, capsys):
    """Extract the array and compare each cached sample with the chat template applied, here, to the turns
    FastChat/SpecForge keep: system kept, assistant turns before the first user turn dropped, speakers mapped."""
    data = _array(tmp_path / "d.json", GOOD_SET)
    out = tmp_path / "cache"
    rc, stdout, err = _extract(tiny_teacher_dir, data, out, capsys)
    assert rc == 0, err
    assert "records read: 4, used 4, skipped 0; 2 turns before the first user turn dropped from 1 records" in stdout
    expected = {
        0: [("user", Q), ("assistant", A)],
        1: [("user", "Why?"), ("assistant", "Gravity. " * 3), ("user", "More?"), ("assistant", "Tides. " * 3)],
        2: [("system", "Be brief."), ("user", "Qué es un río?"), ("assistant", "Agua que fluye. " * 3)],
        3: [("user", Q), ("assistant", A), ("user", "And lakes?")],
    }
    tok = AutoTokenizer.from_pretrained(tiny_teacher_dir)
    cache = open_cache(str(out))
    assert sorted(cache.index().sample_ids.tolist()) == [0, 1, 2, 3]
    for sid, turns in expected.items():
        text = tok.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False)
        assert cache.read_sample(sid).input_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"], sid


@pytest.mark.parametrize("reason", list(BAD))
def test_each_bad_record_is_an_error_naming_it_without_skip_bad(tiny_teacher_dir, tmp_path, capsys, reason):
    data = _array(tmp_path / "d.json", [GOOD, BAD[reason], GOOD])
    rc, _, err = _estimate(tiny_teacher_dir, data, capsys)
    assert rc == 2 and f"{data}#1: {MESSAGE[reason]}" in err and "--skip-bad" in err and "Traceback" not in err


def test_every_bad_record_is_counted_by_reason_with_skip_bad(tiny_teacher_dir, tmp_path, capsys):
    records = [GOOD, *BAD.values(), SPLIT]
    data = _array(tmp_path / "d.json", records)
    want = ("records read: 9, used 2, skipped 7 (empty conversation 1, missing value 1, no user turn 1, non-string "
            "value 1, not an object 1, turns do not alternate 1, unknown role 1); 2 turns before the first user turn "
            "dropped from 1 records")
    rc, est, err = _estimate(tiny_teacher_dir, data, capsys, "--skip-bad")
    assert rc == 0 and want in est and "skipped: 7 bad (7 when read, 0 when tokenized)" in est, err
    out = tmp_path / "cache"
    rc, stdout, err = _extract(tiny_teacher_dir, data, out, capsys, "--skip-bad")
    assert rc == 0 and want in stdout and "skipped: 7 bad records" in stdout, err
    assert sorted(open_cache(str(out)).index().sample_ids.tolist()) == [0, 8]  # ids are positions in the file
    regen = tmp_path / "regen.jsonl"
    assert _run("regenerate", *_base(tiny_teacher_dir, "--set", "regenerate.max_new_tokens=4"), "--data", str(data),
                "--out", str(regen), "--skip-bad", "--no-progress") == 0
    assert want in capsys.readouterr().out
    assert [json.loads(line)["id"] for line in regen.read_text().splitlines()] == [0, 8]


# conversations that alternate in their first exchange and stop later (the turn numbers are the file's: system
# turns and turns dropped before the first user turn count)
LATE_BREAKS = {
    "turn 3": ({"id": "l_3", "conversations": [_turn("human", Q), _turn("gpt", A), _turn("human", "And lakes?"),
                                               _turn("human", "Hello?"), _turn("gpt", A)]},
               "turn 3 is 'user' where 'assistant' was expected"),
    "turn 5": ({"id": "l_5", "conversations": [_turn("system", "Be brief."), _turn("human", Q), _turn("gpt", A),
                                               _turn("human", "And lakes?"), _turn("gpt", A), _turn("gpt", A)]},
               "turn 5 is 'assistant' where 'user' was expected"),
    "turn 6 of a split piece": ({"id": "l_6", "conversations": [_turn("gpt", "...and so on."), _turn("human", Q),
                                                                _turn("gpt", A), _turn("human", "Why?"),
                                                                _turn("chatgpt", A), _turn("human", "More?"),
                                                                _turn("human", "Hello?")]},
                                "turn 6 is 'user' where 'assistant' was expected"),
}


@pytest.mark.parametrize("where", list(LATE_BREAKS))
def test_turns_that_stop_alternating_after_the_first_exchange_are_an_error_naming_the_turn(
        tiny_teacher_dir, tmp_path, capsys, where):
    record, message = LATE_BREAKS[where]
    data = _array(tmp_path / "d.json", [GOOD, record, GOOD])
    rc, _, err = _estimate(tiny_teacher_dir, data, capsys)
    assert rc == 2 and f"{data}#1: {message}" in err and "--skip-bad" in err and "Traceback" not in err


def test_turns_that_stop_alternating_later_are_counted_skips_with_skip_bad(tiny_teacher_dir, tmp_path, capsys):
    data = _array(tmp_path / "d.json", [GOOD, *(r for r, _ in LATE_BREAKS.values()), SPLIT])
    want = ("records read: 5, used 2, skipped 3 (turns do not alternate 3); 2 turns before the first user turn "
            "dropped from 1 records")
    rc, est, err = _estimate(tiny_teacher_dir, data, capsys, "--skip-bad")
    assert rc == 0 and want in est and "skipped: 3 bad (3 when read, 0 when tokenized)" in est, (est, err)
    out = tmp_path / "cache"
    rc, stdout, err = _extract(tiny_teacher_dir, data, out, capsys, "--skip-bad")
    assert rc == 0 and want in stdout and "skipped: 3 bad records" in stdout, err
    assert sorted(open_cache(str(out)).index().sample_ids.tolist()) == [0, 4]  # ids are positions in the file


def _truncated(tmp_path: Path, name: str = "cut.json") -> tuple[Path, int, int]:
    """Three complete records, then the fourth cut off mid-string: ``(path, byte where record 4 starts, size)``."""
    head = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in [GOOD, SYSTEM, GOOD]) + ",\n"
    fourth = json.dumps(SPLIT, ensure_ascii=False)
    raw = (head + fourth[:len(fourth) // 2]).encode("utf-8")
    path = tmp_path / name
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    return path, len(head.encode("utf-8")), len(raw)


@pytest.mark.parametrize("name", ["cut.json", "cut.json.gz"])
def test_a_truncated_array_names_the_byte_and_the_complete_records(tiny_teacher_dir, tmp_path, capsys, name):
    data, start, size = _truncated(tmp_path, name)
    rc, _, err = _estimate(tiny_teacher_dir, data, capsys)
    assert rc == 2 and "Traceback" not in err
    assert (f"{data}: the JSON array is cut off at byte {size} (end of file), inside record #3 that starts at byte "
            f"{start}, after 3 complete records") in err and "--skip-bad to use the 3 complete records" in err
    rc, est, err = _estimate(tiny_teacher_dir, data, capsys, "--skip-bad")
    assert rc == 0 and "records read: 4, used 3, skipped 1 (truncated array 1)" in est and "kept 3 samples" in est
    out = tmp_path / "cache"
    rc, stdout, err = _extract(tiny_teacher_dir, data, out, capsys, "--skip-bad")
    assert rc == 0 and "records read: 4, used 3, skipped 1 (truncated array 1)" in stdout, err
    assert sorted(open_cache(str(out)).index().sample_ids.tolist()) == [0, 1, 2]


def test_an_array_without_its_closing_bracket_and_malformed_json_inside(tiny_teacher_dir, tmp_path, capsys):
    text = json.dumps([GOOD, GOOD], indent=1)
    data = tmp_path / "open.json"
    data.write_text(text[:text.rindex("]")])
    rc, _, err = _estimate(tiny_teacher_dir, data, capsys)
    assert rc == 2 and f"the JSON array ends at byte {len(text) - 1} without its closing ']', after 2 complete" in err
    head = "[" + json.dumps(GOOD) + ", "
    second = json.dumps(GOOD).replace('"conversations":', '"conversations"')  # a missing colon in record 1
    data.write_text(head + second + ", " + json.dumps(GOOD) + "]")
    at = len(head) + second.index('"conversations" ') + len('"conversations" ')
    rc, _, err = _estimate(tiny_teacher_dir, data, capsys)
    assert rc == 2 and "Traceback" not in err
    assert (f"{data}: malformed JSON at byte {at} (Expecting ':' delimiter), in record #1 that starts at byte "
            f"{len(head)}, after 1 complete records") in err
    rc, est, _ = _estimate(tiny_teacher_dir, data, capsys, "--skip-bad")  # the rest of the file is one bad record
    assert rc == 0 and "records read: 2, used 1, skipped 1 (broken array tail 1)" in est


def test_regenerate_answers_the_user_turns_and_counts_prompts_past_max_length(tiny_teacher_dir, tmp_path, capsys):
    long_q = "Tell me everything about rivers and their tides. " * 40  # far past max_length=96 tokens alone
    records = [*GOOD_SET, {"id": "long", "conversations": [_turn("human", long_q), _turn("gpt", A)]},
               {"id": "late", "conversations": [_turn("human", Q), _turn("gpt", A), _turn("human", long_q),
                                                _turn("gpt", A)]}]
    data = _array(tmp_path / "d.json", records)
    regen = tmp_path / "regen.jsonl"
    assert _run("regenerate", *_base(tiny_teacher_dir, "--set", "regenerate.max_new_tokens=6", "--set",
                                     "data.max_length=96", "--set", "cache.bucket_edges=[32, 64]"),
                "--data", str(data), "--out", str(regen),
                "--no-progress") == 0
    out = capsys.readouterr().out
    assert "records read: 6, used 6, skipped 0; 2 turns before the first user turn dropped from 1 records" in out
    assert "regenerated 5 conversations (7 replies)" in out
    assert "1 conversations cut there (1 replies not generated), 1 with a first prompt that long not written" in out
    got = {r["id"]: r["messages"] for r in map(json.loads, regen.read_text().splitlines())}
    assert sorted(got) == [0, 1, 2, 3, 5]
    roles = {i: [m["role"] for m in msgs] for i, msgs in got.items()}
    assert roles == {0: ["user", "assistant"], 1: ["user", "assistant", "user", "assistant"],
                     2: ["system", "user", "assistant"], 3: ["user", "assistant", "user", "assistant"],
                     5: ["user", "assistant"]}  # 3's final user turn answered; 5 stops before the long prompt
    assert [m["content"] for m in got[1] if m["role"] == "user"] == ["Why?", "More?"]


def test_the_stream_matches_one_json_load_across_window_edges(tmp_path, monkeypatch):
    """Records larger than the read window, multi-byte characters and numbers cut at a window's edge: the
    stream decodes what one json.loads of the whole file does (the reference, for a small file)."""
    from extract import data

    monkeypatch.setattr(data, "_CHUNK", 7)  # bytes per read: every record spans several windows
    records = [GOOD, 12345678901234567890, SYSTEM, {"n": [1.5e300, -0.0, True, None], "s": "ü€𝄞\\n\"\\\\"}, [], "x"]
    for name, indent in [("a.json", None), ("b.json", 3), ("c.json.gz", 1)]:
        raw = ("\ufeff \n" + json.dumps(records, indent=indent, ensure_ascii=False) + "\n").encode("utf-8")
        path = tmp_path / name
        path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
        got = list(data.iter_json_records(path))
        assert [w for w, _ in got] == [f"{path}#{i}" for i in range(len(records))]
        assert [o for _, o in got] == json.loads(raw.decode("utf-8-sig"))

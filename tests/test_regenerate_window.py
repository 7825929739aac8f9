"""``dflash-extract regenerate`` streams its input: the in-process back end regenerates ``regenerate.window``
conversations at a time and writes them in input order, so a small window gives the same bytes as one window
holding the whole input, and the conversations alive at any moment are bounded by the window, not the input
(counted by the garbage collector, not by the code under test); the endpoint back end holds only the
conversations in flight."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from extract.cli import main
from extract.data import Record
from extract.regenerate import Regenerator

sys.path.insert(0, str(Path(__file__).parent))
from openai_server import InstantBackend, OpenAIServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LONG = "Tell me everything about rivers and their tides. " * 30  # past data.max_length=80 tokens alone


def _turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


def _conversations(n: int) -> list:
    """ShareGPT records of several shapes: one to three replies, a final user turn, a prompt cut at
    max_length (first or later turn), and a bad record every 50 (skipped and counted with --skip-bad)."""
    out: list = []
    for i in range(n):
        q = f"Question {i}: why do rivers {'bend' if i % 3 else 'flood'}?"
        kind = i % 7
        if i % 50 == 49:
            out.append({"id": f"bad{i}", "conversations": []})
        elif kind == 0:
            out.append({"id": i, "conversations": [_turn("human", q), _turn("gpt", "Because.")]})
        elif kind == 1:
            out.append({"id": i, "conversations": [_turn("human", q), _turn("gpt", "x"), _turn("human", "More?")]})
        elif kind == 2:
            out.append({"id": i, "conversations": [_turn("human", q), _turn("gpt", "a"), _turn("human", "b"),
                                                   _turn("gpt", "c"), _turn("human", f"{i}?"), _turn("gpt", "d")]})
        elif kind == 3 and i % 2:
            out.append({"id": i, "conversations": [_turn("human", LONG), _turn("gpt", "a")]})
        elif kind == 4 and i % 2:
            out.append({"id": i, "conversations": [_turn("human", q), _turn("gpt", "a"), _turn("human", LONG),
                                                   _turn("gpt", "b")]})
        else:
            out.append({"id": i, "conversations": [_turn("system", "Be brief."), _turn("human", q)]})
    return out


def _data(tmp_path: Path, n: int) -> Path:
    path = tmp_path / f"d{n}.json"
    path.write_text(json.dumps(_conversations(n), indent=1), encoding="utf-8")
    return path


def _regen(teacher: Path, data: Path, out: Path, window: int, *extra: str) -> int:
    args = ["regenerate", "configs/tiny.toml", "--data", str(data), "--out", str(out), "--no-progress", "--skip-bad"]
    for s in (f"teacher.path={teacher}", "regenerate.max_new_tokens=3", "regenerate.batch_size=8",
              "data.max_length=80", "cache.bucket_edges=[32, 64]", f"regenerate.window={window}", *extra):
        args += ["--set", s]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main(args)
    finally:
        os.chdir(cwd)


def test_a_small_window_writes_the_same_bytes_as_one_window_over_everything(tiny_teacher_dir, tmp_path, capsys):
    n = 300
    data = _data(tmp_path, n)
    small, whole = tmp_path / "small.jsonl", tmp_path / "whole.jsonl"
    assert _regen(tiny_teacher_dir, data, small, 7) == 0
    out_small = capsys.readouterr().out
    assert _regen(tiny_teacher_dir, data, whole, 10 * n) == 0
    out_whole = capsys.readouterr().out
    assert small.read_bytes() == whole.read_bytes()
    assert out_small.replace(str(small), "OUT") == out_whole.replace(str(whole), "OUT")
    # the counts, from the input as built here: 6 bad records, the long first prompts not written
    bad = [i for i in range(n) if i % 50 == 49]
    first_long = [i for i in range(n) if i not in bad and i % 7 == 3 and i % 2]
    later_long = [i for i in range(n) if i not in bad and i % 7 == 4 and i % 2]
    assert f"records read: {n}, used {n - len(bad)}, skipped {len(bad)} (empty conversation {len(bad)})" in out_small
    assert (f"{len(later_long)} conversations cut there ({len(later_long)} replies not generated), "
            f"{len(first_long)} with a first prompt that long not written") in out_small
    ids = [json.loads(line)["id"] for line in small.read_text().splitlines()]
    assert ids == [i for i in range(n) if i not in bad and i not in first_long]  # input order
    assert not list(tmp_path.glob(".*.tmp"))


def _peak_live(monkeypatch, kinds: tuple[type, ...]) -> dict[type, int]:
    """Count the live objects of each kind (gc's view of the heap) at every generate call; the peaks."""
    peak = dict.fromkeys(kinds, 0)
    real = Regenerator.generate

    def counting(self, prompts):
        counts = dict.fromkeys(kinds, 0)
        for obj in gc.get_objects():
            for k in kinds:
                if type(obj) is k:
                    counts[k] += 1
        for k in kinds:
            peak[k] = max(peak[k], counts[k])
        return real(self, prompts)

    monkeypatch.setattr(Regenerator, "generate", counting)
    return peak


def test_in_process_memory_follows_the_window_not_the_input(tiny_teacher_dir, tmp_path, monkeypatch, capsys):
    from extract.turns import TurnCursor

    window = 12
    peaks = {}
    for n in (100, 400):
        peak = _peak_live(monkeypatch, (Record, TurnCursor))
        assert _regen(tiny_teacher_dir, _data(tmp_path, n), tmp_path / f"o{n}.jsonl", window) == 0
        assert f"records read: {n}," in capsys.readouterr().out
        peaks[n] = peak
        monkeypatch.undo()
    for n, peak in peaks.items():
        # a window's cursors (and their records) plus the one record the reader is on; never the input
        assert window <= peak[TurnCursor] <= window + 1, (n, peak)
        assert window <= peak[Record] <= window + 2, (n, peak)


@pytest.mark.parametrize("concurrency", [3])
def test_the_endpoint_holds_only_the_conversations_in_flight(tiny_teacher_dir, tmp_path, concurrency, capsys):
    from extract.turns import TurnCursor

    n = 120
    data = _data(tmp_path, n)
    seen: list[int] = []
    one_at_a_time = threading.Lock()  # gc.get_objects()'s list keeps alive what it lists: never two at once

    class Counting(InstantBackend):
        def complete(self, body):
            with one_at_a_time:
                seen.append(sum(1 for o in gc.get_objects() if type(o) is TurnCursor))
            return super().complete(body)

    out = tmp_path / "e.jsonl"
    with OpenAIServer(Counting(), str(tiny_teacher_dir)) as server:
        args = ["regenerate", "configs/tiny.toml", "--data", str(data), "--out", str(out), "--no-progress",
                "--skip-bad", "--endpoint", server.url, "--set", f"teacher.path={tiny_teacher_dir}",
                "--set", f"regenerate.max_concurrency={concurrency}"]
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            assert main(args) == 0
        finally:
            os.chdir(cwd)
    text = capsys.readouterr().out
    assert f"records read: {n}, used {n - 2}, skipped 2" in text
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == [
        i for i in range(n) if i % 50 != 49]
    assert len(seen) > n and max(seen) <= concurrency + 1, str(seen)

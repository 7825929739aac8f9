"""Bad input to ``dflash-extract`` through the real command: each is exit 2 with a message naming the
file/path/field and what to do (or, with ``--skip-bad``, a counted skip) -- never a traceback, never
a silent reshape, and never a cache that a fixed rerun cannot use."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_cache import open_cache
from dflash_cache.storage import LocalStorage
from extract.cli import main

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Explain rivers."}, {"role": "assistant", "content": "Rivers move water. " * 3}]


def _args(teacher: Path, out: Path, data: Path | str, *extra: str) -> list[str]:
    return ["configs/tiny.toml", "--out", str(out), "--data", str(data), "--no-progress",
            "--set", f"teacher.path={teacher}", "--set", "extract.unit_size=4", "--set", "data.min_loss_tokens=2",
            *extra]


def _run(*args: str) -> int:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return main(list(args))
    finally:
        os.chdir(cwd)


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _n_samples(out: Path) -> int:
    return len(open_cache(str(out)).index())


def test_corrupt_parquet_file_in_a_data_directory(tiny_teacher_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "a.jsonl", [{"messages": CHAT}] * 3)
    (data / "b.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    out = tmp_path / "cache"
    assert _run(*_args(tiny_teacher_dir, out, data)) == 2
    err = capsys.readouterr().err
    assert f"{data / 'b.parquet'}: not a readable Parquet file" in err and "--skip-bad" in err
    assert "Traceback" not in err and not out.exists()
    assert _run(*_args(tiny_teacher_dir, out, data, "--skip-bad")) == 0
    captured = capsys.readouterr()
    assert "1 unreadable files" in captured.out and f"skipped an unreadable file: {data / 'b.parquet'}" in captured.err
    assert _n_samples(out) == 3


def test_tool_calls_are_refused_not_dropped(tiny_teacher_dir, tmp_path, capsys):
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}]}
    records = [{"messages": CHAT},
               {"messages": [CHAT[0], call, {"role": "tool", "content": "sunny"}, CHAT[1]]},
               {"messages": [CHAT[0], {"role": "tool", "content": "sunny"}, CHAT[1]]},
               {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "weather"}}]}]
    data = _jsonl(tmp_path / "tools.jsonl", records)
    out = tmp_path / "cache"
    assert _run(*_args(tiny_teacher_dir, out, data)) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: message 1 is a tool call" in err and "not supported" in err and "--skip-bad" in err
    assert _run(*_args(tiny_teacher_dir, out, data, "--skip-bad")) == 0
    assert "skipped: 3 bad records" in capsys.readouterr().out  # counted, and no emptied assistant turn written
    assert open_cache(str(out)).index().sample_ids.tolist() == [0]


@pytest.mark.parametrize("bad", [{"messages": [CHAT[0]]}, {"input_ids": [1, 2, 99999], "loss_mask": [0, 1, 1]}],
                         ids=["no-assistant-turn", "token-out-of-vocab"])
def test_records_are_checked_before_the_cache_exists(tiny_teacher_dir, tmp_path, capsys, bad):
    """A record that only tokenization finds bad is refused before the cache exists, so the fixed
    data (a new dataset fingerprint) runs into the same --out."""
    records = [{"messages": CHAT}] * 9 + [bad] + [{"messages": CHAT}] * 2
    data = _jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "cache"
    assert _run(*_args(tiny_teacher_dir, out, data)) == 2
    err = capsys.readouterr().err
    assert "1 of 12 records cannot be tokenized (checked before creating the cache)" in err
    assert f"{data}:10:" in err and not out.exists()
    _jsonl(data, records[:9] + records[10:])  # the fix
    assert _run(*_args(tiny_teacher_dir, out, data)) == 0
    assert _n_samples(out) == 11


def test_out_pointing_at_a_file(tiny_teacher_dir, tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("not a directory")
    assert _run(*_args(tiny_teacher_dir, out, _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}]))) == 2
    assert f"{out} is a file, not a cache directory" in capsys.readouterr().err
    assert out.read_text() == "not a directory"


def test_config_cross_checks_name_the_fields(tiny_teacher_dir, tmp_path, capsys):
    args = _args(tiny_teacher_dir, tmp_path / "c", "builtin:tiny-chat?n=4", "--set", "cache.bucket_edges=[64, 512]",
                 "--set", "extract.tokens_per_batch=256")
    assert _run(*args) == 2
    err = capsys.readouterr().err
    assert "cache.bucket_edges: edges [512] are not below data.max_length (512)" in err
    assert "extract.tokens_per_batch: is below data.max_length (512)" in err
    assert _run(*_args(tiny_teacher_dir, tmp_path / "c", "builtin:tiny-chat?n=4", "--set",
                       "cache.bucket_edges=[128, 64]")) == 2
    assert "cache.bucket_edges: Value error, must be strictly increasing" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["buckets/0/zarr.json", "head.safetensors", "meta/extract_report.json"])
def test_disk_full_outside_parts_is_exit_2_naming_the_path(tiny_teacher_dir, tmp_path, capsys, monkeypatch, key):
    real_put = LocalStorage.put

    def full(self, k, data, durable=False):
        if k == key:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.root / k))
        return real_put(self, k, data, durable)

    monkeypatch.setattr(LocalStorage, "put", full)
    out = tmp_path / "cache"
    assert _run(*_args(tiny_teacher_dir, out, "builtin:tiny-chat?n=4")) == 2
    err = capsys.readouterr().err
    assert "no space left on the device (or over quota) while" in err and str(out / key) in err
    assert "free space, or choose another --out, and rerun the same command" in err
    monkeypatch.setattr(LocalStorage, "put", real_put)
    assert _run(*_args(tiny_teacher_dir, out, "builtin:tiny-chat?n=4")) == 0  # the same command then completes


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` and tmpfs mounts (user namespaces)")
@pytest.mark.parametrize(("size", "stage"), [("8k", r"creating the cache"),
                                             ("256k", r"writing the teacher head \(head\.safetensors\)"),
                                             # parts: the disk fills under a part's data or the next unit's lease
                                             ("1m", r"(writing part|leasing the parts of unit) ")])
def test_a_real_full_disk_is_exit_2_naming_the_path(tiny_teacher_dir, tmp_path, size, stage):
    """The real command on a small tmpfs (private mount namespace): the disk fills while creating the
    cache, while writing the head, or while writing parts."""
    out = tmp_path / "small" / "cache"
    out.parent.mkdir()
    cmd = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size="$0" tmpfs "$1" && shift && exec "$@"', size,
           str(out.parent), sys.executable, "-m", "extract.cli",
           *_args(tiny_teacher_dir, out, "builtin:tiny-chat?n=40")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert re.search(rf"no space left on the device \(or over quota\) while {stage}", r.stderr), r.stderr[-2000:]
    assert str(out) in r.stderr and "Traceback" not in r.stderr


_SURROGATE = '{"messages": [{"role": "user", "content": "bad \\ud800 text"}, {"role": "assistant", "content": "ok"}]}'
_DEEP = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize("line, found", [
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": ["hi"]}]}, CHAT[1]]}),
     "content part 0 is text of type list"),
    (json.dumps({"messages": [{"role": "user", "content": [["hi"]]}, CHAT[1]]}), "content part 0 is a list"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, CHAT[1]]}),
     "content part 0 is type 'image_url'"),
    (_SURROGATE, "a lone surrogate"),
    (_DEEP, "nested too deeply"),
], ids=["list-in-text-part", "list-of-lists", "image-part", "lone-surrogate", "100k-deep"])
def test_bad_content_is_refused_by_name_then_skipped_and_counted(tiny_teacher_dir, tmp_path, capsys, line, found):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([json.dumps({"messages": CHAT})] * 4 + [line] + [json.dumps({"messages": CHAT})] * 3)
                    + "\n")
    out = tmp_path / "cache"
    assert _run(*_args(tiny_teacher_dir, out, data)) == 2
    err = capsys.readouterr().err
    assert f"{data}:5: " in err and found in err and "Traceback" not in err and not out.exists()
    assert _run(*_args(tiny_teacher_dir, out, data, "--skip-bad")) == 0
    assert "skipped: 1 bad records" in capsys.readouterr().out
    assert _run(*_args(tiny_teacher_dir, out, data, "--skip-bad")) == 0  # its rerun finishes too
    assert _n_samples(out) == 7


def test_a_data_directory_reads_every_data_file_and_names_the_rest(tiny_teacher_dir, tmp_path, capsys):
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "a.jsonl", [{"messages": CHAT}] * 2)
    _jsonl(data / "B.JSONL", [{"messages": CHAT}] * 3)  # upper-case suffix: read
    (data / "c.jsonl.gz").write_bytes(gzip.compress(("".join(json.dumps({"messages": CHAT}) + "\n"
                                                              for _ in range(4))).encode()))  # compressed: read
    (data / "d.csv").write_text("role,content\nuser,hi\n")
    (data / "sub").mkdir()
    _jsonl(data / "sub" / "e.jsonl", [{"messages": CHAT}] * 5)
    out = tmp_path / "cache"
    assert _run(*_args(tiny_teacher_dir, out, data)) == 2
    err = capsys.readouterr().err
    assert "holds 2 entries that are not data files (d.csv, sub/)" in err and "--skip-bad" in err
    assert "Traceback" not in err and not out.exists()
    assert _run(*_args(tiny_teacher_dir, out, data, "--skip-bad")) == 0
    assert "2 unreadable files" in capsys.readouterr().out  # counted, by name in the log
    assert _n_samples(out) == 9

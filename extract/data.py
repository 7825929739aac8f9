"""Input data: conversations (JSONL / Parquet / saved HF dataset / ``builtin:tiny-chat``) or
pre-tokenized records (``input_ids`` + ``loss_mask``).

Every record gets a stable ``sample_id``: its 0-based position in the dataset (bad records keep
their id, so skipping them never shifts the others). Errors name ``file:line`` (JSONL) or
``file#row`` (columnar formats). A file that cannot be read at all (a corrupt Parquet file) is an
error naming it, or with ``skip_bad`` a counted skip of the whole file.

Tool calling is refused, not reshaped: a record with assistant ``tool_calls``, ``tool`` turns or a
``tools`` list is a bad record (a counted skip with ``skip_bad``). Dropping the calls would leave
empty assistant turns to train on, and the loss mask of a tool call depends on how each chat
template renders it, which the masking here does not locate yet.

A ``.json`` / ``.jsonl`` file (gzip-compressed or not) is read as a stream, whatever its name says: when its
first non-space byte is ``[`` it is one JSON array of records (ShareGPT as distributed), read record by record
(:func:`iter_json_records`, never one ``json.load``), else one record per line. A truncated or broken array is an
error naming the byte offset and the complete records before it; with ``skip_bad`` those records are used and
the rest of the file is one counted bad record.

Conversation conventions (ShareGPT ``from``/``value`` and ``messages`` alike), as FastChat, SpecForge and EAGLE
prepare ShareGPT: speakers ``human``/``user`` -> user, ``gpt``/``chatgpt``/``bing``/``bard``/``assistant`` ->
assistant, ``system``; leading system turns are kept; turns before the first user turn are dropped and counted
(ShareGPT splits long conversations, so later pieces start with the assistant); after that the turns must
alternate user/assistant (the peers assert it). An empty conversation, a non-string or missing ``value``, an
unknown speaker, no user turn, or turns that do not alternate make a bad record: an error naming
``file:line`` / ``file#record``, or a skip counted by reason with ``skip_bad`` (:class:`ReadCounts`).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import logging
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_cache.errors import DataError

from .builtin_text import builtin_conversations, builtin_prompts

log = logging.getLogger(__name__)

BUILTIN_DATA = "builtin:tiny-chat"
ROLES = ("system", "user", "assistant")
_TOOLS_REFUSED = ("tool-calling conversations are not supported: their calls would be dropped from the assistant "
                  "turns; remove such records, or pass --skip-bad to skip them (they are counted)")
# ShareGPT speakers (FastChat's human/gpt, plus the chatgpt/bing/bard of SpecForge's prepare_data.py)
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                   "bard": "assistant", "assistant": "assistant", "system": "system"}

__all__ = ["BUILTIN_DATA", "Record", "ReadCounts", "LoadedData", "RecordError", "iter_records", "iter_json_records",
           "load_records", "data_fingerprint", "builtin_prompts"]


class RecordError(DataError):
    """One bad record; ``reason`` is the short name its skip is counted under."""

    def __init__(self, message: str, reason: str = "invalid record"):
        super().__init__(message)
        self.reason = reason


def reason_of(err: DataError) -> str:
    return getattr(err, "reason", "invalid record")


@dataclass
class Record:
    """One input record: a conversation or a pre-tokenized sample."""

    sample_id: int
    source: str  # "file:line", "file#row" or "builtin:tiny-chat#i"
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    turns_dropped: int = 0  # turns before the first user turn, dropped (ShareGPT's split conversations)

    @property
    def pretokenized(self) -> bool:
        return self.input_ids is not None


@dataclass
class ReadCounts:
    """What one pass over the data read: records seen, used, skipped by reason, turns dropped."""

    n_total: int = 0  # records seen, bad ones included (= next free sample id)
    n_used: int = 0
    bad: list[str] = field(default_factory=list)  # "source: reason" of skipped records
    reasons: Counter[str] = field(default_factory=Counter)  # skipped records by reason
    bad_files: list[str] = field(default_factory=list)  # "file: reason" of whole files skipped (skip_bad)
    records_trimmed: int = 0  # records whose turns before the first user turn were dropped
    turns_dropped: int = 0

    def add_bad(self, err: DataError) -> None:
        self.bad.append(str(err))
        self.reasons[reason_of(err)] += 1

    def summary(self) -> str:
        """One line: ``records read: N, used U, skipped S (reason n, ...); ...``."""
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items(), key=lambda kv: (-kv[1], kv[0])))
        line = f"records read: {self.n_total}, used {self.n_used}, skipped {len(self.bad)}" + (f" ({why})" if why else "")
        if self.bad_files:
            line += f"; unreadable files skipped: {len(self.bad_files)}"
        return line + (f"; {self.turns_dropped} turns before the first user turn dropped from {self.records_trimmed} "
                       "records")


@dataclass
class LoadedData:
    records: list[Record]
    n_total: int  # records seen, bad ones included (= next free sample id)
    bad: list[str] = field(default_factory=list)  # "source: reason" of skipped records
    fingerprint: str = ""
    bad_files: list[str] = field(default_factory=list)  # "file: reason" of whole files skipped (skip_bad)
    counts: ReadCounts = field(default_factory=ReadCounts)


def _text(value: str, where: str) -> str:
    """``value`` when it is valid Unicode (a lone surrogate from a ``\\ud800`` escape is not, and no
    tokenizer takes it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = value[err.start:err.end].encode("unicode_escape").decode()
        raise RecordError(f"{where}: text holds {bad} at character {err.start}, a lone surrogate (invalid Unicode, "
                        "from a broken \\u escape); fix the record or pass --skip-bad", "invalid unicode") from None
    return value


def _normalize_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _text(content, where)
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: text only; anything else is refused, not dropped
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type", "text") if isinstance(part, dict) else None
            text = part.get("text", "") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(text, str):
                found = (f"a {type(part).__name__}" if not isinstance(part, dict) else
                         f"type {kind!r}" if kind != "text" else f"text of type {type(text).__name__}")
                raise RecordError(f"{where}: content part {i} is {found}; only {{\"type\": \"text\", \"text\": "
                                "string} parts are supported (fix the record, or pass --skip-bad to skip it)", "unsupported content")
            texts.append(_text(text, where))
        return "".join(texts)
    raise RecordError(f"{where}: message content must be a string or a list of text parts, found {type(content).__name__}",
                      "non-string value")


def _parse_messages(raw: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise RecordError(f"{where}: 'messages' must be a list of {{role, content}} objects, found "
                          f"{type(raw).__name__}", "invalid record")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RecordError(f"{where}: message {i} is {type(m).__name__}, expected an object with role and content",
                              "invalid turn")
        role = m.get("role")
        if role == "tool" or m.get("tool_calls") or m.get("function_call"):
            raise RecordError(f"{where}: message {i} is a tool call or a tool result ({_TOOLS_REFUSED})", "tool calls")
        if role not in ROLES:
            raise RecordError(f"{where}: message {i} has unknown role {role!r}; expected one of {list(ROLES)}",
                              "unknown role")
        msg = {"role": role, "content": _normalize_content(m.get("content"), where)}
        if m.get("reasoning_content"):
            msg["reasoning_content"] = _text(str(m["reasoning_content"]), where)
        out.append(msg)
    return out


def _parse_sharegpt(raw: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise RecordError(f"{where}: 'conversations' must be a list of {{from, value}} objects, found "
                          f"{type(raw).__name__}", "invalid record")
    msgs = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RecordError(f"{where}: turn {i} is {type(m).__name__}, expected an object with from and value",
                              "invalid turn")
        speaker = m.get("from")
        role = _SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise RecordError(f"{where}: turn {i} has unknown speaker {speaker!r}; expected one of "
                              f"{list(_SHAREGPT_ROLES)} (fix the record or pass --skip-bad)", "unknown role")
        if "value" not in m:
            raise RecordError(f"{where}: turn {i} ({speaker}) has no 'value'; fix the record or pass --skip-bad",
                              "missing value")
        value = m["value"]
        if not isinstance(value, str):
            raise RecordError(f"{where}: turn {i} ({speaker}) has a value of type {type(value).__name__}, expected a "
                              "string; fix the record or pass --skip-bad", "non-string value")
        msgs.append({"role": role, "content": _text(value, where)})
    return msgs


def conversation_turns(msgs: list[dict[str, str]], where: str) -> tuple[list[dict[str, str]], int]:
    """``(messages, turns dropped)``: leading system turns kept, the turns before the first user turn dropped,
    the rest checked to alternate user/assistant (FastChat and SpecForge drop a leading non-user turn and assert
    alternation; an assertion here is a bad record instead)."""
    if not msgs:
        raise RecordError(f"{where}: empty conversation (no turns); remove it or pass --skip-bad", "empty conversation")
    n_sys = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    first_user = next((i for i in range(n_sys, len(msgs)) if msgs[i]["role"] == "user"), None)
    if first_user is None:
        raise RecordError(f"{where}: no user turn (roles {[m['role'] for m in msgs][:8]}); nothing to answer or "
                          "train on; remove it or pass --skip-bad", "no user turn")
    body = msgs[first_user:]
    for j, m in enumerate(body):
        expected = ("user", "assistant")[j % 2]
        if m["role"] != expected:
            raise RecordError(f"{where}: turn {first_user + j} is {m['role']!r} where {expected!r} was expected: "
                              "after the leading system turns, turns must alternate user/assistant; fix the record "
                              "or pass --skip-bad", "turns do not alternate")
    return msgs[:n_sys] + body, first_user - n_sys


def _int_list(raw: Any, name: str, where: str) -> list[int]:
    if not isinstance(raw, list | tuple) and not hasattr(raw, "tolist"):
        raise RecordError(f"{where}: '{name}' must be a list of integers", "invalid pre-tokenized record")
    values = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    if not all(isinstance(v, int | bool) for v in values):
        raise RecordError(f"{where}: '{name}' must contain integers only", "invalid pre-tokenized record")
    return [int(v) for v in values]


def parse_record(obj: Any, sample_id: int, where: str) -> Record:
    """Validate one decoded record (conversation or pre-tokenized)."""
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: expected a JSON object, found {type(obj).__name__}; fix the record or pass "
                          "--skip-bad", "not an object")
    if obj.get("input_ids") is not None:
        ids = _int_list(obj["input_ids"], "input_ids", where)
        if "loss_mask" not in obj:
            raise RecordError(f"{where}: pre-tokenized record has input_ids but no loss_mask", "invalid pre-tokenized record")
        mask = _int_list(obj["loss_mask"], "loss_mask", where)
        if len(ids) != len(mask):
            raise RecordError(f"{where}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}", "invalid pre-tokenized record")
        if not ids or any(v not in (0, 1) for v in mask) or min(ids) < 0:
            raise RecordError(f"{where}: expected non-empty input_ids >= 0 and a 0/1 loss_mask", "invalid pre-tokenized record")
        return Record(sample_id, where, input_ids=ids, loss_mask=mask)
    if obj.get("tools"):
        raise RecordError(f"{where}: the record declares tools ({_TOOLS_REFUSED})", "tool calls")
    if obj.get("messages") is not None:
        msgs = _parse_messages(obj["messages"], where)
    elif obj.get("conversations") is not None:
        msgs = _parse_sharegpt(obj["conversations"], where)
    else:
        msgs = None
    if msgs is not None:
        msgs, dropped = conversation_turns(msgs, where)
        return Record(sample_id, where, messages=msgs, turns_dropped=dropped)
    raise RecordError(
        f"{where}: expected a 'messages' list (role/content), ShareGPT 'conversations', or 'input_ids' + "
        f"'loss_mask'; found keys {sorted(obj)} (fix the record or pass --skip-bad)", "invalid record"
    )


_CHUNK = 1 << 20  # bytes read at a time from a JSON array
_WHITESPACE = " \t\r\n"


def _open(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def iter_json_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``(where, decoded object | DataError)`` for each record of a JSON file, read as a stream: one JSON array
    of records when the first non-space byte is ``[`` (``where`` = ``file#i``, 0-based), else one record per
    non-blank line (``where`` = ``file:line``). gzip-compressed when the name ends in ``.gz``.

    A bad line is a ``DataError`` in its place; a broken array (cut off, or malformed JSON) is one ``DataError``
    for the whole rest of the file, naming the byte offset and the complete records before it. Memory stays
    bounded by the largest record, not the file."""
    path = Path(path)
    try:
        with _open(path) as f:
            head = f.read(4096)
            while head and not head.lstrip(b"\xef\xbb\xbf" + _WHITESPACE.encode()):
                more = f.read(4096)
                if not more:
                    break
                head += more
        array = head.lstrip(b"\xef\xbb\xbf" + _WHITESPACE.encode()).startswith(b"[")
    except (OSError, EOFError, zlib.error) as err:
        yield f"{path}:1", DataError(f"{path}: unreadable ({type(err).__name__}: {err}); replace the file or pass "
                                     "--skip-bad")
        return
    yield from (_iter_json_array(path) if array else _iter_jsonl(path))


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    lineno = 0
    try:
        with _open(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield where, json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    yield where, RecordError(f"{where}: malformed JSON ({err}); fix the line or pass --skip-bad",
                                             "malformed JSON")
                except RecursionError:
                    yield where, RecordError(f"{where}: JSON nested too deeply to read; fix the line or pass "
                                             "--skip-bad", "malformed JSON")
    except (OSError, EOFError, zlib.error) as err:  # a truncated or corrupt .gz: the rest of the file
        yield f"{path}:{lineno + 1}", RecordError(f"{path}: unreadable after line {lineno} ({type(err).__name__}: "
                                                  f"{err}); replace the file or pass --skip-bad", "unreadable tail")


class _ArrayStream:
    """The records of one JSON array, decoded one at a time from a window of the file
    (``json.JSONDecoder.raw_decode`` at a position; the window grows only while a record does not fit)."""

    def __init__(self, f: Any):
        self.f = f
        self.decode_text = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos = "", 0  # decoded window, position in it
        self.base = 0  # file bytes before buf[0]
        self.eof = False
        self._known = (0, 0)  # (position in buf, its file byte offset): offsets are counted on from there

    def byte_offset(self, pos: int | None = None) -> int:
        """File byte offset of ``buf[pos]``, encoding only the text since the last offset asked for (a window of
        non-ASCII text re-encoded from its start for every record cost O(window) each, 28x slower at 4x)."""
        pos = self.pos if pos is None else pos
        at, off = self._known if self._known[0] <= pos else (0, self.base)
        off += len(self.buf[at:pos].encode("utf-8", "surrogatepass"))
        self._known = (pos, off)
        return off

    def fill(self) -> bool:
        """Drop what is consumed and read more (at least as much as is buffered, so a record of n bytes costs
        O(n) decoding, not O(n^2)); False at the end of the file."""
        if self.eof:
            return False
        self.base = self.byte_offset()
        self.buf, self.pos = self.buf[self.pos:], 0
        self._known = (0, self.base)
        raw = self.f.read(max(_CHUNK, len(self.buf)))
        self.eof = not raw
        self.buf += self.decode_text.decode(raw, final=self.eof)  # UnicodeDecodeError: the caller's
        return True

    def skip_space(self) -> str:
        """The next non-space character ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""

    def value(self, decoder: json.JSONDecoder) -> Any:
        """Decode the value at ``pos``; more of the file is read while the error is at the window's end."""
        while True:
            try:
                obj, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as err:
                at_end = err.msg.startswith("Unterminated string") or err.pos >= len(self.buf) - 8
                if at_end and self.fill():
                    continue
                raise
            if end < len(self.buf) or self.eof:  # a number at the window's end may go on: read on
                self.pos = end
                return obj
            self.fill()


def _iter_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    decoder = json.JSONDecoder()
    n = 0  # complete records so far
    start = 0
    try:
        with _open(path) as f:
            s = _ArrayStream(f)
            if s.skip_space() == "\ufeff":  # a UTF-8 byte-order mark
                s.pos += 1
            s.skip_space()
            s.pos += 1  # the opening '[' (the caller saw it)
            while True:
                c = s.skip_space()
                if c == "]" and n == 0:
                    s.pos += 1
                    break
                if n:
                    if c == "]":
                        s.pos += 1
                        break
                    if c != ",":
                        raise json.JSONDecodeError("Expecting ',' delimiter" if c else "Unterminated array", s.buf,
                                                   s.pos)
                    s.pos += 1
                    c = s.skip_space()
                start = s.byte_offset()
                if not c:
                    raise json.JSONDecodeError("Unterminated array", s.buf, s.pos)
                yield f"{path}#{n}", s.value(decoder)
                n += 1
            if s.skip_space():
                yield f"{path}#{n}", RecordError(
                    f"{path}: data after the closing ']' of the JSON array at byte {s.byte_offset()} (after {n} "
                    "records); remove it, or pass --skip-bad to use the records (the rest is counted as one bad "
                    "record)", "broken array tail")
    except json.JSONDecodeError as err:
        at = s.byte_offset(err.pos)
        size = s.byte_offset(len(s.buf)) if s.eof else None
        if err.msg == "Unterminated array":  # between records
            msg = (f"{path}: the JSON array ends at byte {s.byte_offset(len(s.buf))} without its closing ']', after "
                   f"{n} complete records")
            reason = "truncated array"
        elif size is not None and (err.msg.startswith("Unterminated") or err.pos >= len(s.buf) - 8):
            msg = (f"{path}: the JSON array is cut off at byte {size} (end of file), inside record #{n} that starts "
                   f"at byte {start}, after {n} complete records")
            reason = "truncated array"
        else:
            msg = (f"{path}: malformed JSON at byte {at} ({err.msg}), in record #{n} that starts at byte {start}, "
                   f"after {n} complete records")
            reason = "broken array tail"
        yield f"{path}#{n}", RecordError(f"{msg}; repair or re-download the file, or pass --skip-bad to use the "
                                          f"{n} complete records (the rest of the file is counted as one bad record)",
                                          reason)
    except RecursionError:
        yield f"{path}#{n}", RecordError(f"{path}: record #{n} (at byte {start}) is nested too deeply to read, after "
                                          f"{n} complete records; fix it, or pass --skip-bad to use them (the rest "
                                          "is counted as one bad record)", "broken array tail")
    except UnicodeDecodeError as err:
        yield f"{path}#{n}", RecordError(f"{path}: not valid UTF-8 near byte {s.base + len(s.buf.encode('utf-8', 'surrogatepass')) + err.start} "
                                          f"({err.reason}), after {n} complete records; fix the file, or pass "
                                          "--skip-bad to use them (the rest is counted as one bad record)",
                                          "broken array tail")
    except (OSError, EOFError, zlib.error) as err:
        yield f"{path}#{n}", RecordError(f"{path}: unreadable after record #{n - 1} ({type(err).__name__}: {err}); "
                                          "replace the file or pass --skip-bad", "unreadable tail")


def _iter_table(table: Any, path: Path) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}#{i}", row


class UnreadableFileError(DataError):
    """A whole data file cannot be read (corrupt, truncated, not the format its name says)."""


def _unreadable(path: Path, kind: str, err: Exception) -> UnreadableFileError:
    return UnreadableFileError(f"{path}: not a readable {kind} file ({type(err).__name__}: {err}); replace or remove "
                               "it, or pass --skip-bad to skip the whole file (counted)")


def _read_parquet(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise _unreadable(path, "Parquet", err) from None


def _read_arrow(path: Path) -> Any:
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError, ValueError) as err:
        raise _unreadable(path, "Arrow", err) from None


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _load_saved_dataset(path: Path) -> Any:
    """A ``save_to_disk`` directory through ``datasets.load_from_disk``: the Dataset, or a DatasetDict's
    ``train`` split."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a saved Hugging Face dataset (save_to_disk); reading it needs the datasets "
                        "package: pip install 'dflash-pipeline[hf]' (or pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError, TypeError, FileNotFoundError) as err:
        raise DataError(f"{path}: not a readable saved dataset ({type(err).__name__}: {err}); re-save it with "
                        "Dataset.save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (found {sorted(ds)}); point at one split")
        ds = ds["train"]
    return ds


_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".arrow")  # any letter case


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in _SUFFIXES if name.endswith(s)), None)


def _data_files(path: Path, skip_bad: bool = False) -> tuple[list[Path], list[str]]:
    """``(files to read, "entry: reason" of entries skipped)``. Entries of a directory that are not data
    files (another suffix, a subdirectory) are refused by name, or skipped and counted with ``skip_bad``;
    hidden names (``.*``) are ignored."""
    if path.is_file():
        return [path], []
    entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    files = [p for p in entries if p.is_file() and _kind(p) is not None]
    other = [p for p in entries if p not in files]
    skipped = [f"{p}: {'a subdirectory' if p.is_dir() else 'not a data file'} (read are "
               f"{', '.join(_SUFFIXES)} files, in any letter case)" for p in other]
    if other and not skip_bad:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in other[:5])
        raise DataError(f"{path}: holds {len(other)} entr{'y' if len(other) == 1 else 'ies'} that are not data files "
                        f"({names}{', ...' if len(other) > 5 else ''}); this reader takes {', '.join(_SUFFIXES)} files "
                        "(any letter case) directly in the directory. Move the others out, or pass --skip-bad to "
                        "skip them (counted)")
    if not files:
        raise DataError(f"{path}: directory holds no .jsonl/.parquet/.arrow files and is not a saved HF dataset")
    return files, skipped


def _iter_file(path: Path) -> Iterator[tuple[str, Any]]:
    """Records of one file. A columnar file is read whole first, so an unreadable one yields nothing."""
    kind = _kind(path)
    if kind == ".parquet":
        return _iter_table(_read_parquet(path), path)
    if kind == ".arrow":
        return _iter_table(_read_arrow(path), path)
    return iter_json_records(path)


def _file_fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        try:
            with p.open("rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
        except OSError as err:
            raise DataError(f"{p}: cannot be read ({err.strerror}); check the file and its permissions") from None
    return h.hexdigest()[:16]


def _builtin(path: str) -> list[dict]:
    name, _, count = path.partition("?n=")
    if name != BUILTIN_DATA:
        raise DataError(f"data.path {path!r}: unknown built-in data set; the only one is {BUILTIN_DATA!r}")
    return builtin_conversations() if not count else builtin_conversations(int(count))


def _sources(path: str, skip_bad: bool) -> tuple[list[Path], list[Any], list[str]]:
    """``(files, readers, skipped entries)``: the files the fingerprint covers, one callable per file that
    yields ``(where, object | DataError)``, and the directory entries skipped (``skip_bad``)."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data.path {path}: no such file or directory")
    if _is_saved_dataset(root):
        ds = _load_saved_dataset(root)
        files = [Path(f["filename"]) for f in ds.cache_files]
        return files, [lambda: _iter_table(ds.with_format("arrow")[:], root)], []  # rows named root#i
    files, skipped = _data_files(root, skip_bad)
    return files, [lambda file=file: _iter_file(file) for file in files], skipped


def data_fingerprint(path: str) -> str:
    """The input data's fingerprint (recorded in the cache): a hash of every data file's bytes."""
    if path.startswith("builtin:"):
        return hashlib.sha256(json.dumps(_builtin(path), sort_keys=True).encode()).hexdigest()[:16]
    files, _, _ = _sources(path, skip_bad=True)
    return _file_fingerprint(files)


def iter_records(path: str, skip_bad: bool = False, counts: ReadCounts | None = None,
                 warn: bool = True) -> Iterator[Record]:
    """Every good record of ``path`` in dataset order, read as a stream (a JSON array or JSONL file is never
    read whole). A bad record raises :class:`DataError` naming it, or with ``skip_bad`` is skipped and counted
    in ``counts`` by reason; ``counts`` also gets the records seen and used and the leading turns dropped.

    Conversations come as ``Record.messages``: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``,
    starting (after any system turns) with a user turn and alternating; ``Record.sample_id`` is the record's
    0-based position in the data (bad records keep theirs). ``warn``: log the skips at the end (a second pass
    over the same data does not)."""
    counts = ReadCounts() if counts is None else counts
    if path.startswith("builtin:"):
        for i, c in enumerate(_builtin(path)):
            counts.n_total += 1
            counts.n_used += 1
            yield Record(i, f"{BUILTIN_DATA}#{i}", messages=c["messages"])
        return
    _, readers, skipped = _sources(path, skip_bad)
    counts.bad_files.extend(skipped)
    for entry in skipped:
        log.warning("skipped a directory entry that is not a data file: %s", entry)
    for read in readers:
        try:
            items = read()
        except UnreadableFileError as err:
            if not skip_bad:
                raise
            counts.bad_files.append(str(err))
            log.warning("skipped an unreadable file: %s", err)
            continue
        for where, obj in items:
            sample_id = counts.n_total
            counts.n_total += 1
            try:
                if isinstance(obj, DataError):
                    raise obj
                record = parse_record(obj, sample_id, where)
            except DataError as err:
                if not skip_bad:
                    raise
                counts.add_bad(err)
                continue
            counts.n_used += 1
            if record.turns_dropped:
                counts.records_trimmed += 1
                counts.turns_dropped += record.turns_dropped
            yield record
    if counts.n_total == 0:
        note = f" ({len(counts.bad_files)} unreadable file(s) skipped)" if counts.bad_files else " (the file is empty)"
        raise DataError(f"data.path {path}: no records found{note}; expected a JSON array of records or one record "
                        "per line")
    if counts.bad and warn:
        log.warning("skipped %d bad record(s); first: %s", len(counts.bad), counts.bad[0])


def load_records(path: str, skip_bad: bool = False) -> LoadedData:
    """Every record of ``path`` in memory (:func:`iter_records` collected, with the data fingerprint)."""
    counts = ReadCounts()
    records = list(iter_records(path, skip_bad, counts))
    return LoadedData(records, counts.n_total, counts.bad, data_fingerprint(path), counts.bad_files, counts)

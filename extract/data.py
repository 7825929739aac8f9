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
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import zlib
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
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}

__all__ = ["BUILTIN_DATA", "Record", "LoadedData", "load_records", "load_conversations", "builtin_prompts"]


@dataclass
class Record:
    """One input record: a conversation or a pre-tokenized sample."""

    sample_id: int
    source: str  # "file:line", "file#row" or "builtin:tiny-chat#i"
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None

    @property
    def pretokenized(self) -> bool:
        return self.input_ids is not None


@dataclass
class LoadedData:
    records: list[Record]
    n_total: int  # records seen, bad ones included (= next free sample id)
    bad: list[str] = field(default_factory=list)  # "source: reason" of skipped records
    fingerprint: str = ""
    bad_files: list[str] = field(default_factory=list)  # "file: reason" of whole files skipped (skip_bad)


def _text(value: str, where: str) -> str:
    """``value`` when it is valid Unicode (a lone surrogate from a ``\\ud800`` escape is not, and no
    tokenizer takes it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = value[err.start:err.end].encode("unicode_escape").decode()
        raise DataError(f"{where}: text holds {bad} at character {err.start}, a lone surrogate (invalid Unicode, "
                        "from a broken \\u escape); fix the record or pass --skip-bad") from None
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
                raise DataError(f"{where}: content part {i} is {found}; only {{\"type\": \"text\", \"text\": "
                                "string} parts are supported (fix the record, or pass --skip-bad to skip it)")
            texts.append(_text(text, where))
        return "".join(texts)
    raise DataError(f"{where}: message content must be a string or a list of text parts, found {type(content).__name__}")


def _parse_messages(raw: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {i} is {type(m).__name__}, expected an object with role and content")
        role = m.get("role")
        if role == "tool" or m.get("tool_calls") or m.get("function_call"):
            raise DataError(f"{where}: message {i} is a tool call or a tool result ({_TOOLS_REFUSED})")
        if role not in ROLES:
            raise DataError(f"{where}: message {i} has unknown role {role!r}; expected one of {list(ROLES)}")
        msg = {"role": role, "content": _normalize_content(m.get("content"), where)}
        if m.get("reasoning_content"):
            msg["reasoning_content"] = _text(str(m["reasoning_content"]), where)
        out.append(msg)
    return out


def _parse_sharegpt(raw: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise DataError(f"{where}: 'conversations' must be a list of {{from, value}} objects")
    msgs = []
    for i, m in enumerate(raw):
        role = _SHAREGPT_ROLES.get(m.get("from")) if isinstance(m, dict) else None
        if role is None:
            raise DataError(f"{where}: turn {i} has unknown speaker {m!r}; expected one of {list(_SHAREGPT_ROLES)}")
        msgs.append({"role": role, "content": m.get("value", "")})
    return _parse_messages(msgs, where)


def _int_list(raw: Any, name: str, where: str) -> list[int]:
    if not isinstance(raw, list | tuple) and not hasattr(raw, "tolist"):
        raise DataError(f"{where}: '{name}' must be a list of integers")
    values = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    if not all(isinstance(v, int | bool) for v in values):
        raise DataError(f"{where}: '{name}' must contain integers only")
    return [int(v) for v in values]


def parse_record(obj: Any, sample_id: int, where: str) -> Record:
    """Validate one decoded record (conversation or pre-tokenized)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    if obj.get("input_ids") is not None:
        ids = _int_list(obj["input_ids"], "input_ids", where)
        if "loss_mask" not in obj:
            raise DataError(f"{where}: pre-tokenized record has input_ids but no loss_mask")
        mask = _int_list(obj["loss_mask"], "loss_mask", where)
        if len(ids) != len(mask):
            raise DataError(f"{where}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
        if not ids or any(v not in (0, 1) for v in mask) or min(ids) < 0:
            raise DataError(f"{where}: expected non-empty input_ids >= 0 and a 0/1 loss_mask")
        return Record(sample_id, where, input_ids=ids, loss_mask=mask)
    if obj.get("tools"):
        raise DataError(f"{where}: the record declares tools ({_TOOLS_REFUSED})")
    if obj.get("messages") is not None:
        return Record(sample_id, where, messages=_parse_messages(obj["messages"], where))
    if obj.get("conversations") is not None:
        return Record(sample_id, where, messages=_parse_sharegpt(obj["conversations"], where))
    raise DataError(
        f"{where}: expected a 'messages' list (role/content), ShareGPT 'conversations', or 'input_ids' + "
        f"'loss_mask'; found keys {sorted(obj)}"
    )


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, decoded object | DataError)`` for each non-blank line (gzip-compressed when the name
    ends in ``.gz``)."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield where, json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    yield where, DataError(f"{where}: malformed JSON ({err}); fix the line or pass --skip-bad")
                except RecursionError:
                    yield where, DataError(f"{where}: JSON nested too deeply to read; fix the line or pass --skip-bad")
    except (OSError, EOFError, zlib.error) as err:  # a truncated or corrupt .gz: the rest of the file
        yield f"{path}:{lineno + 1}", DataError(f"{path}: unreadable after line {lineno} ({type(err).__name__}: "
                                                f"{err}); replace the file or pass --skip-bad")


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
    return _iter_jsonl(path)


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


def _load_builtin(n: int | None) -> LoadedData:
    convs = builtin_conversations() if n is None else builtin_conversations(n)
    records = [Record(i, f"{BUILTIN_DATA}#{i}", messages=c["messages"]) for i, c in enumerate(convs)]
    digest = hashlib.sha256(json.dumps(convs, sort_keys=True).encode()).hexdigest()[:16]
    return LoadedData(records, len(records), fingerprint=digest)


def load_records(path: str, skip_bad: bool = False) -> LoadedData:
    """Read every record of ``path`` in dataset order; malformed records raise, or are skipped when asked."""
    if path.startswith("builtin:"):
        name, _, count = path.partition("?n=")
        if name != BUILTIN_DATA:
            raise DataError(f"data.path {path!r}: unknown built-in data set; the only one is {BUILTIN_DATA!r}")
        return _load_builtin(int(count) if count else None)
    root = Path(path)
    if not root.exists():
        raise DataError(f"data.path {path}: no such file or directory")
    if _is_saved_dataset(root):
        ds = _load_saved_dataset(root)
        files = [Path(f["filename"]) for f in ds.cache_files]
        readers = [lambda: _iter_table(ds.with_format("arrow")[:], root)]  # one Arrow table, rows named root#i
        skipped: list[str] = []
    else:
        files, skipped = _data_files(root, skip_bad)
        readers = [lambda file=file: _iter_file(file) for file in files]
    out = LoadedData([], 0, fingerprint=_file_fingerprint(files), bad_files=list(skipped))
    for entry in skipped:
        log.warning("skipped a directory entry that is not a data file: %s", entry)
    for read in readers:
        try:
            items = read()
        except UnreadableFileError as err:
            if not skip_bad:
                raise
            out.bad_files.append(str(err))
            log.warning("skipped an unreadable file: %s", err)
            continue
        for where, obj in items:
            sample_id = out.n_total
            out.n_total += 1
            try:
                if isinstance(obj, DataError):
                    raise obj
                out.records.append(parse_record(obj, sample_id, where))
            except DataError as err:
                if not skip_bad:
                    raise
                out.bad.append(str(err))
    if out.n_total == 0:
        skipped = f" ({len(out.bad_files)} unreadable file(s) skipped)" if out.bad_files else " (the file is empty)"
        raise DataError(f"data.path {path}: no records found{skipped}; expected one conversation per line")
    if out.bad:
        log.warning("skipped %d bad record(s); first: %s", len(out.bad), out.bad[0])
    return out


def load_conversations(path: str, skip_bad: bool = False) -> list[list[dict[str, str]]]:
    """The ``messages`` of every conversation record of ``path`` (pre-tokenized records are an error)."""
    loaded = load_records(path, skip_bad=skip_bad)
    for r in loaded.records:
        if r.messages is None:
            raise DataError(f"{r.source}: a pre-tokenized record where conversations are needed")
    return [r.messages for r in loaded.records if r.messages is not None]

"""Chat templating and assistant-only loss masks.

The mask is found by rendering prefixes of the conversation: the assistant turn ``i`` spans from
the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of its own rendering.
Templates that render earlier turns differently once later turns exist (Qwen3 drops the think
block of history turns) are handled by locating the turn's content inside the full rendering.
No generation markers (``{% generation %}``) are needed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_cache.errors import ConfigError, DataError

from .data import Record


@dataclass
class TemplateOptions:
    system_prompt: str | None = None
    enable_thinking: bool | None = None

    def kwargs(self) -> dict[str, Any]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


@dataclass
class TokenizedSample:
    sample_id: int
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]
    truncated: bool = False

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def n_loss(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TokenizeStats:
    n_samples: int = 0  # kept
    n_tokens: int = 0
    n_loss_tokens: int = 0
    n_truncated: int = 0
    n_too_few_loss: int = 0
    n_bad: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def add(self, other: TokenizeStats) -> None:
        for k in ("n_samples", "n_tokens", "n_loss_tokens", "n_truncated", "n_too_few_loss", "n_bad"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.bad_examples = (self.bad_examples + other.bad_examples)[:5]

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "bad_examples"}


def check_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the teacher tokenizer ({type(tokenizer).__name__}) has no chat template: conversations cannot be "
            "tokenized; use a chat model's tokenizer, add chat_template to tokenizer_config.json, or pass "
            "pre-tokenized records (input_ids + loss_mask)"
        )


def tokenizer_hash(tokenizer: Any, options: TemplateOptions) -> str:
    """Hash of the vocabulary, the chat template and the template options (part of the cache spec)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update(json.dumps([options.system_prompt, options.enable_thinking]).encode())
    return h.hexdigest()[:16]


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool, options: TemplateOptions) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **options.kwargs()
    )


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _assistant_span(tokenizer: Any, messages: list[dict], i: int, full: str, cursor: int, opts: TemplateOptions,
                    where: str) -> tuple[int, int]:
    """Character span ``[start, end)`` of assistant turn ``i`` inside ``full``, searching from ``cursor``."""
    try:
        pre = _render(tokenizer, messages[:i], True, opts)
        upto = _render(tokenizer, messages[: i + 1], False, opts)
    except Exception as err:  # jinja raise_exception, an empty prefix: a bad record, never a traceback
        raise DataError(f"{where}: the chat template rejected the turns before assistant turn {i}: {err}") from None
    start = len(pre) if full.startswith(pre) else _common_prefix(pre, full)
    start = max(start, cursor)
    if full.startswith(upto):
        end = len(upto)
    else:  # rendered differently as history: find the content, then the turn's closing text
        content = messages[i]["content"]
        pos = full.find(content, start) if content else start
        if pos < 0:
            raise DataError(f"{where}: assistant turn {i} could not be located in the chat-template rendering")
        tail = upto[len(pre):] if upto.startswith(pre) else ""
        closing = tail[tail.rfind(content) + len(content):] if content and content in tail else ""
        end = pos + len(content)
        if closing and full.startswith(closing, end):
            end += len(closing)
    while end > start and full[end - 1].isspace():  # template glue after the end-of-turn token
        end -= 1
    return start, end


def _mask_from_offsets(tokenizer: Any, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    # a token is in the mask when its first character falls in a span; spans are sorted and disjoint, so one
    # binary search per token (a Python any() over every span was half the time on long ShareGPT conversations)
    first = np.fromiter((a for a, _ in offsets), dtype=np.int64, count=len(offsets))
    span_start = np.asarray([s for s, _ in spans], dtype=np.int64)
    span_end = np.asarray([e for _, e in spans], dtype=np.int64)
    k = np.searchsorted(span_start, first, side="right") - 1
    mask = (k >= 0) & (first < span_end[np.maximum(k, 0)])
    return ids, mask.tolist()


def _mask_from_prefixes(tokenizer: Any, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """For tokenizers without offsets: token counts of the text before each span boundary."""
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    mask = [False] * len(ids)
    for s, e in spans:
        a = len(tokenizer(full[:s], add_special_tokens=False)["input_ids"])
        b = len(tokenizer(full[:e], add_special_tokens=False)["input_ids"])
        mask[a:b] = [True] * (b - a)
    return ids, mask


def tokenize_conversation(tokenizer: Any, messages: list[dict], options: TemplateOptions,
                          where: str = "conversation") -> tuple[list[int], list[bool]]:
    """``(input_ids, loss_mask)`` of the whole conversation; the mask covers assistant turns only."""
    check_chat_template(tokenizer)
    if options.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": options.system_prompt}, *messages]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: conversation has no assistant turn (nothing to learn); regenerate it first "
                        "or drop it")
    try:
        full = _render(tokenizer, messages, False, options)
    except Exception as err:  # jinja raise_exception, template errors
        raise DataError(f"{where}: the chat template rejected this conversation: {err}") from None
    spans, cursor = [], 0
    for i in turns:
        span = _assistant_span(tokenizer, messages, i, full, cursor, options, where)
        spans.append(span)
        cursor = span[1]
    if getattr(tokenizer, "is_fast", False):
        return _mask_from_offsets(tokenizer, full, spans)
    return _mask_from_prefixes(tokenizer, full, spans)


def tokenize_record(record: Record, tokenizer: Any, options: TemplateOptions, max_length: int,
                    vocab_size: int | None = None) -> TokenizedSample:
    """Tokenize (or validate) one record and truncate it to ``max_length``."""
    if record.pretokenized:
        ids, mask = record.input_ids, record.loss_mask
        if vocab_size is not None and max(ids) >= vocab_size:
            raise DataError(f"{record.source}: token id {max(ids)} >= the teacher vocab size {vocab_size}")
    else:
        ids, mask = tokenize_conversation(tokenizer, record.messages, options, record.source)
    truncated = len(ids) > max_length
    return TokenizedSample(
        record.sample_id, np.asarray(ids[:max_length], dtype=np.int64), np.asarray(mask[:max_length], dtype=bool),
        truncated,
    )


def iter_samples(records: Iterable[Record], tokenizer: Any, options: TemplateOptions, max_length: int,
                 min_loss_tokens: int, stats: TokenizeStats, skip_bad: bool = False,
                 vocab_size: int | None = None) -> Iterator[TokenizedSample]:
    """Tokenize ``records`` one at a time (a stream stays a stream), counting into ``stats``; samples with fewer
    than ``min_loss_tokens`` loss tokens are dropped (and counted)."""
    for rec in records:
        try:
            s = tokenize_record(rec, tokenizer, options, max_length, vocab_size)
        except DataError as err:
            if not skip_bad:
                raise
            stats.n_bad += 1
            stats.bad_examples.append(str(err))
            continue
        stats.n_truncated += s.truncated
        if s.n_loss < min_loss_tokens:
            stats.n_too_few_loss += 1
            continue
        stats.n_samples += 1
        stats.n_tokens += s.length
        stats.n_loss_tokens += s.n_loss
        yield s


def prepare_samples(records: Iterable[Record], tokenizer: Any, options: TemplateOptions, max_length: int,
                    min_loss_tokens: int, skip_bad: bool = False,
                    vocab_size: int | None = None) -> tuple[list[TokenizedSample], TokenizeStats]:
    """Tokenize ``records``; drop (and count) samples with fewer than ``min_loss_tokens`` loss tokens."""
    stats = TokenizeStats()
    kept = list(iter_samples(records, tokenizer, options, max_length, min_loss_tokens, stats, skip_bad, vocab_size))
    return kept, stats


@dataclass(frozen=True)
class SampleRules:
    """How records become training samples (the `data` section and `model.block_size` resolved once)."""

    template: TemplateOptions
    max_length: int  # longer samples are truncated (and counted)
    min_loss_tokens: int  # samples with fewer loss tokens are dropped (and counted)
    skip_bad: bool  # a record that cannot be tokenized is counted and skipped instead of an error

    def prepare(self, records: Iterable[Record], tokenizer: Any, vocab_size: int | None = None,
                skip_bad: bool | None = None) -> tuple[list[TokenizedSample], TokenizeStats]:
        """:func:`prepare_samples` under these rules (``skip_bad`` overrides the configured one)."""
        return prepare_samples(records, tokenizer, self.template, self.max_length, self.min_loss_tokens,
                               skip_bad=self.skip_bad if skip_bad is None else skip_bad, vocab_size=vocab_size)

    def iter(self, records: Iterable[Record], tokenizer: Any, stats: TokenizeStats, vocab_size: int | None = None,
             skip_bad: bool | None = None) -> Iterator[TokenizedSample]:
        """:func:`iter_samples` under these rules: one sample at a time, counted into ``stats``."""
        return iter_samples(records, tokenizer, self.template, self.max_length, self.min_loss_tokens, stats,
                            self.skip_bad if skip_bad is None else skip_bad, vocab_size)

"""The turns of a conversation being regenerated, shared by both back ends of ``dflash-extract regenerate``
(in-process, :mod:`extract.regenerate`, and a server, :mod:`extract.endpoint`): which turns get a reply, the
history each reply answers, the assistant message made of a reply, and the output record.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_cache.errors import DataError
from dflash_cache.runtime.schema import PipelineConfig

from .data import ReadCounts, Record, data_fingerprint, iter_records


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` for generations with a ``<think>...</think>`` block."""
    if "</think>" not in text:
        return None, text.strip()
    reasoning, _, answer = text.partition("</think>")
    return reasoning.replace("<think>", "").strip("\n") or None, answer.strip()


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string (excluded), as the serving engines return it."""
    cut = min((i for s in stop if s and (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def reply_message(text: str, reasoning: str | None = None) -> dict[str, str]:
    """The assistant message for a generated reply; ``reasoning`` given apart (a server's reasoning parser)
    or inside ``text`` as a ``<think>`` block."""
    if reasoning is None:
        reasoning, answer = split_reasoning(text)
    else:
        reasoning, answer = reasoning.strip("\n") or None, text.strip()
    msg = {"role": "assistant", "content": answer}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def prompt_turns(messages: list[dict]) -> list[int]:
    """Indices where a reply is generated: each assistant turn, plus the end when the last turn is a user's."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] in ("user", "tool"):
        turns.append(len(messages))
    return turns


class TurnCursor:
    """One conversation's replies in order: ``history()`` is what the next reply answers (input turns up to
    it, earlier replies regenerated), ``add_reply`` moves on. ``messages`` is the result so far."""

    def __init__(self, record: Record):
        assert record.messages is not None
        self.record, self.turns = record, prompt_turns(record.messages)
        if not self.turns:
            raise DataError(f"{record.source}: the conversation has neither an assistant turn nor a final user "
                            "turn to answer")
        self.messages: list[dict] = []
        self.k = 0  # replies done
        self.given_up = 0  # replies not generated (cut)
        self._pos = 0  # next input message to copy

    @property
    def done(self) -> bool:
        return self.k == len(self.turns)

    def history(self) -> list[dict]:
        return self.messages + self.record.messages[self._pos:self.turns[self.k]]  # type: ignore[index]

    def add_reply(self, msg: dict) -> None:
        self.messages = [*self.history(), msg]
        self._pos = self.turns[self.k] + 1
        self.k += 1

    def cut(self) -> int:
        """Stop before the next reply (its prompt is too long); returns the replies given up."""
        self.given_up = len(self.turns) - self.k
        self.turns = self.turns[:self.k]
        return self.given_up


def output_record(cursor: TurnCursor, prompts_fingerprint: str) -> dict[str, Any]:
    """One output line: the input sample id, the regenerated conversation, the input data it came from."""
    return {"id": cursor.record.sample_id, "messages": cursor.messages, "prompts_fingerprint": prompts_fingerprint}


@dataclass
class PromptScan:
    """What one streaming pass over the input found: every conversation has a reply to generate (else the
    pass raised), how many there are and their replies at most (progress totals), the read counts."""

    fingerprint: str
    counts: ReadCounts
    n_conversations: int = 0
    n_replies: int = 0


def scan_prompts(cfg: PipelineConfig) -> PromptScan:
    """Check the input conversations before any generation (pre-tokenized records and conversations with
    nothing to answer are errors) in one pass that holds one record at a time."""
    scan = PromptScan(data_fingerprint(cfg.data.path), ReadCounts())
    for cursor in _cursors(cfg, scan.counts, warn=True):
        scan.n_conversations += 1
        scan.n_replies += len(cursor.turns)
    return scan


def iter_cursors(cfg: PipelineConfig, scan: PromptScan) -> Iterator[TurnCursor]:
    """One cursor per input conversation, in input order, read again as a stream after :func:`scan_prompts`."""
    again = ReadCounts()
    yield from _cursors(cfg, again, warn=False)
    if again.n_total != scan.counts.n_total or again.n_used != scan.counts.n_used:
        raise DataError(f"{cfg.data.path}: changed while being read ({scan.counts.n_total} records, then "
                        f"{again.n_total}); keep the input fixed during regeneration and rerun")


def _cursors(cfg: PipelineConfig, counts: ReadCounts, warn: bool) -> Iterator[TurnCursor]:
    for r in iter_records(cfg.data.path, cfg.data.skip_bad, counts, warn=warn):
        if r.messages is None:
            raise DataError(f"{r.source}: pre-tokenized records cannot be regenerated; give conversations")
        yield TurnCursor(r)

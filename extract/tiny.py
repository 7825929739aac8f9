"""The embedded tiny teacher: a real HF-format Qwen3 model directory built locally (no download).

``build_tiny_teacher(path)`` writes ``config.json`` (``Qwen3ForCausalLM``), ``model.safetensors``
(random init with a fixed seed), and a byte-level BPE tokenizer trained on the built-in text with a
Qwen3-style chat template (``<|im_start|>``/``<|im_end|>``, empty ``<think>`` blocks on the turns
after the last user query). ``resolve_tiny_teacher()`` builds it once into the user cache
directory; ``teacher.path = "builtin:tiny"`` resolves to it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

TINY_VERSION = 1
BUILTIN_TEACHER = "builtin:tiny"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
TINY_MASK_TOKEN_ID = SPECIAL_TOKENS.index("<|mask|>")
TINY_EOS_TOKEN_ID = SPECIAL_TOKENS.index("<|im_end|>")
TINY_PAD_TOKEN_ID = SPECIAL_TOKENS.index("<|endoftext|>")
TOKENIZER_VOCAB = 1024  # an upper bound: the built-in text yields ~760 tokens
MODEL_VOCAB = 768
# Random init alone makes greedy decoding collapse onto a few "hub" tokens. Instead the lm_head
# maps each whole-word token's embedding to a random permutation of the word tokens (a long-cycle
# bigram backbone, so generations are varied, decode to words and re-tokenize identically), and the
# decoder layers (std INIT_STD) bend ~20% of the greedy choices by context.
INIT_STD = 0.09
HEAD_SCALE = 0.05

TINY_DIMS = dict(
    hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=384, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
)

# Qwen3-style: assistant turns after the last user query carry a (possibly empty) think block;
# earlier assistant turns are rendered without it, so prefix renderings are NOT prefixes of the
# full rendering (the case loss masking must handle).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role in ['system', 'user'] -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- raise_exception('unknown role: ' + m.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


def default_tiny_dir() -> Path:
    """``$DFLASH_HOME`` or ``$XDG_CACHE_HOME/dflash-pipeline`` (``~/.cache``), per builder version."""
    root = os.environ.get("DFLASH_HOME")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash-pipeline")
    return Path(root) / f"tiny-teacher-v{TINY_VERSION}"


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .builtin_text import tokenizer_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    return tok


def _save_tokenizer(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _word_token_ids(tok) -> list[int]:
    """Ids of tokens that decode to a space followed by ASCII letters (`` rivers``)."""
    ids = range(len(SPECIAL_TOKENS), tok.get_vocab_size())
    return [i for i in ids if re.fullmatch(r" [A-Za-z]+", tok.decode([i]))]


def _build_model(seed: int, word_ids: list[int]):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=MODEL_VOCAB, tie_word_embeddings=False, initializer_range=INIT_STD,
        bos_token_id=None, eos_token_id=TINY_EOS_TOKEN_ID, pad_token_id=TINY_PAD_TOKEN_ID, **TINY_DIMS,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    words = torch.tensor(word_ids)
    successor = words[torch.randperm(len(words), generator=gen)]  # word_ids[i] -> successor[i]
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [V, H]
        embed.normal_(0.0, 1.0, generator=gen)
        head = model.lm_head.weight  # [V, H]
        head.zero_()
        head[successor] = embed[words] * HEAD_SCALE
    return model.to(torch.float32).eval()


def build_tiny_teacher(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny teacher (config, safetensors weights, tokenizer + chat template) into ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer()
    assert tok.token_to_id("<|mask|>") == TINY_MASK_TOKEN_ID
    assert tok.get_vocab_size() <= MODEL_VOCAB
    _save_tokenizer(tok, out)
    model = _build_model(seed, _word_token_ids(tok))
    model.config.dflash_mask_token_id = TINY_MASK_TOKEN_ID
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "dflash_tiny.json").write_text(json.dumps({"version": TINY_VERSION, "seed": seed}))
    return out


def resolve_tiny_teacher(seed: int = 0) -> Path:
    """The tiny teacher's directory, building it once (atomically, safe with concurrent ranks)."""
    target = default_tiny_dir() if seed == 0 else default_tiny_dir().with_name(
        f"{default_tiny_dir().name}-seed{seed}")
    if (target / "dflash_tiny.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=target.parent))
    try:
        log.info("building the tiny teacher in %s (once)", target)
        build_tiny_teacher(tmp, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "dflash_tiny.json").is_file():  # not a concurrent builder's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

"""The embedded tiny teachers: real HF-format model directories built locally (no download).

``build_tiny_teacher(path, arch=...)`` writes ``config.json``, ``model.safetensors`` (random init with
a fixed seed), and one shared byte-level BPE tokenizer trained on the built-in text with a Qwen3-style
chat template (``<|im_start|>``/``<|im_end|>``, empty ``<think>`` blocks on the turns after the last
user query) whose mask token is ``<|mask|>``. One builder serves every architecture the presets target:

- ``builtin:tiny`` (= ``builtin:tiny-qwen3``): ``Qwen3ForCausalLM``, the Qwen3-8B preset's family.
- ``builtin:tiny-qwen3_5``: ``Qwen3_5ForConditionalGeneration`` (model type ``qwen3_5``, a tiny vision
  tower included), text layers mixing Gated DeltaNet (``linear_attention``) and ``full_attention`` 3:1
  like Qwen3.5/3.6, the Qwen3.6-27B preset's family. ``AutoModelForCausalLM`` loads its text part as
  ``Qwen3_5ForCausalLM``, exactly as it loads the real checkpoint.
- ``builtin:tiny-qwen3_moe``: ``Qwen3MoeForCausalLM`` (4 experts, 2 per token).
- ``builtin:tiny-llama``: ``LlamaForCausalLM``.

``resolve_tiny_teacher(arch=...)`` builds each once into the user cache directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dflash_cache.runtime.switches import env_switch

log = logging.getLogger(__name__)

TINY_VERSION = 2  # 2: the tokenizer declares <|mask|> as its mask token; more architectures
BUILTIN_TEACHER = "builtin:tiny"
DEFAULT_ARCH = "qwen3"
ARCHS = ("qwen3", "qwen3_5", "qwen3_moe", "llama")
BUILTIN_TEACHERS = {BUILTIN_TEACHER: DEFAULT_ARCH, **{f"{BUILTIN_TEACHER}-{a}": a for a in ARCHS}}
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
# Gated DeltaNet layers of the hybrid teacher (the real 27B: 16 key / 48 value heads of 128)
TINY_LINEAR_DIMS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_conv_kernel_dim=4)
TINY_VISION_DIMS = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                        out_hidden_size=TINY_DIMS["hidden_size"])
TINY_MOE_DIMS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)

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


def default_tiny_dir(arch: str = DEFAULT_ARCH) -> Path:
    """``$DFLASH_HOME`` or ``$XDG_CACHE_HOME/dflash-pipeline`` (``~/.cache``), per builder version and
    architecture."""
    root = env_switch("DFLASH_HOME")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dflash-pipeline")
    suffix = "" if arch == DEFAULT_ARCH else f"-{arch}"
    return Path(root) / f"tiny-teacher-v{TINY_VERSION}{suffix}"


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
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", mask_token="<|mask|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _word_token_ids(tok) -> list[int]:
    """Ids of tokens that decode to a space followed by ASCII letters (`` rivers``)."""
    ids = range(len(SPECIAL_TOKENS), tok.get_vocab_size())
    return [i for i in ids if re.fullmatch(r" [A-Za-z]+", tok.decode([i]))]


def _tiny_model(arch: str) -> Any:
    """A randomly initialised tiny model of ``arch`` (seed the global RNG first)."""
    import transformers as tf

    ids = dict(eos_token_id=TINY_EOS_TOKEN_ID, pad_token_id=TINY_PAD_TOKEN_ID, bos_token_id=None)
    text = dict(vocab_size=MODEL_VOCAB, tie_word_embeddings=False, initializer_range=INIT_STD, **ids, **TINY_DIMS)
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**text))
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**text, **TINY_MOE_DIMS))
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**text))
    if arch == "qwen3_5":  # layer_types default: every 4th layer full attention, the others Gated DeltaNet
        config = tf.Qwen3_5Config(text_config={**text, **TINY_LINEAR_DIMS}, vision_config=TINY_VISION_DIMS,
                                  tie_word_embeddings=False, initializer_range=INIT_STD)
        return tf.Qwen3_5ForConditionalGeneration(config)
    raise ValueError(f"unknown tiny teacher architecture {arch!r}; expected one of {list(ARCHS)}")


def _build_model(seed: int, word_ids: list[int], arch: str = DEFAULT_ARCH) -> Any:
    import torch

    torch.manual_seed(seed)
    model = _tiny_model(arch)
    model.generation_config.eos_token_id = TINY_EOS_TOKEN_ID
    model.generation_config.pad_token_id = TINY_PAD_TOKEN_ID
    gen = torch.Generator().manual_seed(seed + 1)
    words = torch.tensor(word_ids)
    successor = words[torch.randperm(len(words), generator=gen)]  # word_ids[i] -> successor[i]
    with torch.no_grad():
        embed = model.get_input_embeddings().weight  # [V, H]
        embed.normal_(0.0, 1.0, generator=gen)
        head = model.get_output_embeddings().weight  # [V, H]
        head.zero_()
        head[successor] = embed[words] * HEAD_SCALE
    return model.to(torch.float32).eval()


def build_tiny_teacher(path: str | Path, seed: int = 0, arch: str = DEFAULT_ARCH) -> Path:
    """Write a tiny ``arch`` teacher (config, safetensors weights, tokenizer + chat template) into ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer()
    assert tok.token_to_id("<|mask|>") == TINY_MASK_TOKEN_ID
    assert tok.get_vocab_size() <= MODEL_VOCAB
    _save_tokenizer(tok, out)
    model = _build_model(seed, _word_token_ids(tok), arch)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "dflash_tiny.json").write_text(json.dumps({"version": TINY_VERSION, "seed": seed, "arch": arch}))
    return out


def resolve_tiny_teacher(seed: int = 0, arch: str = DEFAULT_ARCH) -> Path:
    """The tiny ``arch`` teacher's directory, building it once (atomically, safe with concurrent ranks)."""
    base = default_tiny_dir(arch)
    target = base if seed == 0 else base.with_name(f"{base.name}-seed{seed}")
    if (target / "dflash_tiny.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=target.parent))
    try:
        log.info("building the tiny %s teacher in %s (once)", arch, target)
        build_tiny_teacher(tmp, seed=seed, arch=arch)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "dflash_tiny.json").is_file():  # not a concurrent builder's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

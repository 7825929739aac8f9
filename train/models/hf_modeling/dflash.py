"""DFlash block-diffusion drafter for Hugging Face transformers (``dflash.py`` of an exported drafter).

``dflash-train export`` copies this file beside ``config.json`` (whose ``auto_map`` names
``dflash.DFlashDraftModel``) and ``model.safetensors``, so an export loads and decodes with:

    from transformers import AutoModel, AutoModelForCausalLM
    draft = AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype="auto").eval()
    target = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype="auto").eval()
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=256,
                              stop_token_ids=[tokenizer.eos_token_id], temperature=0.0)  # [1, P + new]

It depends on torch and transformers only. It computes what the drafter was trained to compute:

* context: ``ctx = hidden_norm(fc(concat of the target's layer outputs))``, layer id k being the
  target's ``hidden_states[k + 1]``; computed once and shared by all layers;
* block: ``[last accepted token, MASK x (B-1)]`` embedded with the *target's* embedding; logits
  through the *target's* lm_head (the drafter stores neither);
* every layer: queries are the block rows; keys/values are ``[ctx ; block]`` through the layer's
  own k/v projections, with per-head q_norm/k_norm and RoPE at absolute positions;
* attention rule: a query at absolute position p sees a key at position q when
  - the layer has a sliding window W: ``|p - q| < W`` (the window bounds how far back into the
    context a query sees, and the distance inside the block);
  - the layer is causal within the block: ``q <= p``. As the DFlash reference (dflash 0.1.0) and the
    serving engines read it: the top-level ``is_causal`` (true: every layer, false: none); without it,
    sliding layers are causal and full-attention layers bidirectional. ``dflash_config.sliding_within_block``
    (written by ``dflash-train export`` beside ``is_causal``) says the sliding layers' rule outright.
  Everything else is visible.

The block's token embeddings are multiplied by ``dflash_config.input_embedding_scale`` (default 1), as the
reference does.

DFlash2 (``architectures: ["DFlash2DraftModel"]``, auto_map ``dflash.DFlash2DraftModel``) adds, with the
reference's tensor names and ``dflash_config`` fields:

* ``layers.{i}.attention_conv`` / ``mlp_conv`` (``conv_kernel_size`` taps, ``conv_group_size`` channels per
  dynamic kernel): the normed sublayer input ``x`` is convolved with ``base_kernel[0] + dynamic taps`` (taps
  ``kernel_projection(x)``), causally and within the block; the sublayer's output with ``base_kernel[1]`` plus
  the second set of taps;
* ``candidate_selector`` (``selector_top_k``, ``selector_rank``): the unary top-K of each row is rescored with
  ``<predecessor_codebook[prev] * hidden_projection(h), successor_codebook[candidate]>``, walking the block from
  its anchor; greedy at temperature 0, else sampled from ``softmax(scores / T)`` over the K candidates.

Unary logits are ``lm_head(h) * output_multiplier``, soft-capped by ``final_logit_softcapping`` when set.

Caching: ``past_key_values`` (a transformers ``Cache``) holds each layer's context keys/values for
positions ``0 .. n-1``; a forward appends the new context positions and the block, and the caller
crops the block off again (``spec_generate`` does).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config

SLIDING_WITHIN_BLOCK = ("bidirectional", "causal")


def within_block_causal(config: Qwen3Config, sliding: bool) -> bool:
    """Whether a sliding (or full-attention) layer is causal within the block: ``dflash_config.sliding_within_block``
    for sliding layers when present, else the top-level ``is_causal`` as the DFlash reference reads it (absent:
    sliding layers causal, full layers bidirectional)."""
    dc = dict(getattr(config, "dflash_config", None) or {})
    rule = dc.get("sliding_within_block")
    if sliding and rule is not None:
        if rule not in SLIDING_WITHIN_BLOCK:
            raise ValueError(f"dflash_config.sliding_within_block = {rule!r}: expected one of {list(SLIDING_WITHIN_BLOCK)}")
        return rule == "causal"
    is_causal = getattr(config, "is_causal", None)
    return sliding if is_causal is None else bool(is_causal)


def input_embedding_scale(config: Qwen3Config) -> float:
    """``dflash_config.input_embedding_scale`` (else a top-level one, else 1), as the reference reads it."""
    dc = dict(getattr(config, "dflash_config", None) or {})
    scale = dc.get("input_embedding_scale", getattr(config, "input_embedding_scale", None))
    return 1.0 if scale is None else float(scale)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default target layers when a config names none: uniform from layer 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def extract_context_feature(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """``[B, T, n*H]`` from a target's ``output_hidden_states``: layer k is ``hidden_states[k + 1]``."""
    return torch.cat([hidden_states[k + 1] for k in layer_ids], dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
    """logits [B, L, V] -> token ids [B, L]: argmax at temperature 0, else a softmax sample."""
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    B, L, V = logits.shape
    probs = torch.softmax(logits.reshape(-1, V).float() / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1).view(B, L)


def _prompt_ids(input_ids: Any) -> torch.Tensor:
    """The ``[1, P]`` ids of a prompt given as a tensor or as what ``tokenizer(...)`` /
    ``apply_chat_template(..., return_tensors="pt")`` return (a ``BatchEncoding`` holding ``input_ids``)."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids
    if hasattr(input_ids, "keys") and "input_ids" in input_ids:
        return input_ids["input_ids"]
    raise TypeError(f"spec_generate: input_ids must be a [1, P] tensor of token ids (or a BatchEncoding holding "
                    f"one), got {type(input_ids).__name__}")


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities after temperature, top-k (0: off), top-p (1: off)."""
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    probs = z.softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = torch.zeros_like(sorted_p, dtype=torch.bool).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p >= top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def speculative_sampling(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                         generator: torch.Generator | None = None) -> tuple[int, int]:
    """Rejection sampling of drafts [k] drawn from q [k, V] against the target's p [k+1, V]: ``(accepted,
    next token)``. Draft i is kept with probability min(1, p_i(x_i) / q_i(x_i)) while all before it were; at
    the first rejection the next token is drawn from norm(max(p_i - q_i, 0)), after k acceptances from p_k.
    Every emitted token is then distributed as the target's p (lossless in distribution). CPU tensors."""
    k = int(drafts.shape[0])
    idx = torch.arange(k)
    ratio = p[idx, drafts] / q[idx, drafts]  # [k]
    accepted = int((torch.rand(k, generator=generator) < ratio).long().cumprod(0).sum())
    if accepted < k:
        dist = (p[accepted] - q[accepted]).clamp(min=0)
        dist = dist / dist.sum() if dist.sum() > 0 else p[accepted]
    else:
        dist = p[k]
    return accepted, int(torch.multinomial(dist, 1, generator=generator))


def _cache_keyword(model: nn.Module) -> str:
    """The name under which a transformers model takes and returns its KV cache: ``cache`` in recent
    transformers versions, ``past_key_values`` before (and deprecated after)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _crop(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions (a negative ``crop`` means the same in every transformers version)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope_theta(config: Qwen3Config) -> float:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"DFlash drafter: rope type {rope_type!r} is not supported (trained with default RoPE)")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 1_000_000.0)


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, L] -> (cos, sin) [B, 1, L, D] in float32 (NeoX layout, default rope)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [D/2]
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, L, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, L, D]
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D]; cos/sin [B, 1, L, D]."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        H = config.hidden_size
        self.layer_idx = layer_idx
        self.head_dim = d = getattr(config, "head_dim", None) or H // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=bias)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        sliding = layer_types[layer_idx] == "sliding_attention"
        self.window: int | None = int(config.sliding_window) if sliding else None
        self.causal = within_block_causal(config, sliding)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, n, self.head_dim).transpose(1, 2)  # [B, n, L, d]

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """q_pos [B, Q], k_pos [B, K] -> bool [B, 1, Q, K] (True = may attend), or None (all visible)."""
        if self.window is None and not self.causal:
            return None
        dist = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # [B, Q, K]
        ok = torch.ones_like(dist, dtype=torch.bool)
        if self.window is not None:
            ok &= dist.abs() < self.window
        if self.causal:
            ok &= dist >= 0
        return ok.unsqueeze(1)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, rope_q: Any, rope_k: Any, q_pos: torch.Tensor,
                k_pos: torch.Tensor, past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, Q, H] (normed block rows), ctx [B, C, H] (new fused context) -> [B, Q, H]."""
        B, Q, _ = h.shape
        kv_in = torch.cat([ctx, h], dim=1)  # [B, C+Q, H]
        q = apply_rope(self.q_norm(self._heads(self.q_proj(h), self.num_heads)), *rope_q)  # [B, Hq, Q, d]
        k = apply_rope(self.k_norm(self._heads(self.k_proj(kv_in), self.num_kv_heads)), *rope_k)  # [B, Hkv, C+Q, d]
        v = self._heads(self.v_proj(kv_in), self.num_kv_heads)  # [B, Hkv, C+Q, d]
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)  # [B, Hkv, past+C+Q, d]
        mask = self.mask(q_pos, k_pos)
        if attention_mask is not None:
            mask = attention_mask if mask is None else mask & attention_mask
        groups = self.num_heads // self.num_kv_heads
        kwargs: dict[str, Any] = {}
        if groups > 1 and _SDPA_GQA:
            kwargs["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, **kwargs)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))  # [B, Q, H]


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

        self.attention_conv: DFlashGroupedConv | None = None  # DFlash2 only
        self.mlp_conv: DFlashGroupedConv | None = None

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, **attn: Any) -> torch.Tensor:
        if self.attention_conv is not None and self.mlp_conv is not None:
            x, taps = self.attention_conv.prepare(self.input_layernorm(h))
            h = h + self.attention_conv.finish(self.self_attn(x, ctx, **attn), taps)
            x, taps = self.mlp_conv.prepare(self.post_attention_layernorm(h))
            return h + self.mlp_conv.finish(self.mlp(x), taps)
        h = h + self.self_attn(self.input_layernorm(h), ctx, **attn)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DFlashGeneration:
    """What ``spec_generate(..., return_stats=True)`` returns.

    ``acceptance_lengths``: tokens produced by each draft-verify cycle (accepted drafts + the target's
    own token), counted in full as the DFlash reference (z-lab/dflash 44947fb) and ``dflash-train eval --live``
    count them, also for the last cycle whose tokens past the budget or a stop token are dropped from the
    output; the first cycle always runs (also when the prefill's token is a stop token), and cycles run until
    more than ``max_new_tokens`` tokens exist or a stop token appears. ``tau`` is their mean. (The ``dflash``
    0.1.0 package clips the last cycle instead: ``eval --live --card-tau`` reports that convention.)"""

    output_ids: torch.Tensor  # [1, P + generated]
    num_input_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return int(self.output_ids.shape[1]) - self.num_input_tokens

    @property
    def tau(self) -> float:
        n = self.acceptance_lengths
        return sum(n) / len(n) if n else float("nan")


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter: no embedding and no lm_head of its own (the target's are used)."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dc = dict(getattr(config, "dflash_config", None) or {})
        self.target_layer_ids = [int(k) for k in dc.get("target_layer_ids") or build_target_layer_ids(
            int(getattr(config, "num_target_layers", dc.get("num_target_layers", 0))), config.num_hidden_layers)]
        mask_id = dc.get("mask_token_id", getattr(config, "mask_token_id", None))
        self.mask_token_id = None if mask_id is None else int(mask_id)
        self.block_size = int(dc.get("block_size", getattr(config, "block_size", 16)))
        self.input_embedding_scale = input_embedding_scale(config)
        self.rope_theta = _rope_theta(config)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        H = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    def forward(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        """Final hidden states of the block rows, ``[B, Q, H]`` (apply the target's lm_head for logits).

        noise_embedding [B, Q, H]: the embedded block ``[last token, MASK, ...]``;
        target_hidden [B, C, n*H]: target features of the C context positions not yet in the cache;
        position_ids [B, C+Q] (or [1, C+Q]): their absolute positions, context first;
        past_key_values: a ``Cache`` with the context of positions ``0 .. n-1`` (appended to in place);
        attention_mask: optional bool [B, 1, Q, n+C+Q], combined with the drafter's own rule."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding and target_hidden")
        dtype = self.fc.weight.dtype
        h = noise_embedding.to(dtype)  # [B, Q, H]
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))  # [B, C, H]
        B, Q, C = h.shape[0], h.shape[1], ctx.shape[1]
        position_ids = position_ids.to(h.device).expand(B, -1)  # [B, C+Q]
        if position_ids.shape[1] != C + Q:
            raise ValueError(f"position_ids has {position_ids.shape[1]} positions for {C} context + {Q} block rows")
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        k_pos = torch.cat([torch.arange(past, device=h.device).expand(B, -1), position_ids], dim=1)  # [B, past+C+Q]
        q_pos = position_ids[:, C:]  # [B, Q]
        rope_q = rotary(q_pos, self.head_dim, self.rope_theta)
        rope_k = rotary(position_ids, self.head_dim, self.rope_theta)
        for layer in self.layers:
            h = layer(h, ctx, rope_q=rope_q, rope_k=rope_k, q_pos=q_pos, k_pos=k_pos,
                      past_key_values=past_key_values, attention_mask=attention_mask)
        return self.norm(h)

    def embed_block(self, embed: nn.Module, block: torch.Tensor) -> torch.Tensor:
        """The block's noise embedding [1, B, H]: the target's embedding times ``input_embedding_scale``."""
        x = embed(block).to(self.device)
        return x * self.input_embedding_scale if self.input_embedding_scale != 1.0 else x

    def compute_logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Unary logits [B, L, V] of hidden [B, L, H]: the target's lm_head, ``* output_multiplier``, then
        ``cap * tanh(. / cap)`` with ``final_logit_softcapping``."""
        dc = dict(getattr(self.config, "dflash_config", None) or {})
        logits = head(hidden.to(head.weight.device, head.weight.dtype)).float()
        logits = logits * float(dc.get("output_multiplier", 1.0))
        cap = dc.get("final_logit_softcapping")
        return torch.tanh(logits / float(cap)) * float(cap) if cap else logits

    def draft_tokens(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, head: nn.Module,
                     temperature: float = 0.0) -> torch.Tensor:
        """The drafts [B, L] of a block's rows 1.. (hidden [B, L, H]) after ``anchor_ids`` [B]: the argmax."""
        return self.compute_logits(hidden, head).argmax(dim=-1)

    def draft(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, head: nn.Module, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block's drafts [1, L] (hidden [1, L, H] of rows 1.., after ``anchor_ids`` [1]) and, when sampling,
        the distribution q [L, V] (fp32, CPU) each row was drawn from: what :func:`speculative_sampling`
        verifies against. DFlash: the rows' warped unary distributions, drawn independently."""
        if temperature < 1e-5:
            return self.draft_tokens(hidden, anchor_ids, head), None
        q = warp_probs(self.compute_logits(hidden, head)[0], temperature, top_p, top_k).cpu()  # [L, V]
        return torch.multinomial(q, 1, generator=generator).view(1, -1), q

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: Sequence[int] | None = None, temperature: float = 0.0, *,
                      top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
                      return_stats: bool = False) -> torch.Tensor | DFlashGeneration:
        """Speculative decoding of one prompt with ``target`` (an HF causal LM with a croppable KV cache).

        Each cycle drafts B-1 tokens after the last accepted one in a single drafter forward; the
        target verifies the block in one forward. At temperature 0 it keeps the drafts equal to its own
        greedy choice, plus its next token: the output is the target's greedy output. At temperature > 0
        (with ``top_p`` / ``top_k``) each draft is drawn from the drafter's warped distribution and
        verified by :func:`speculative_sampling`: the output is distributed as the target's own sampling
        with the same settings (``generator``: a CPU generator for reproducible draws). Returns the ids
        ``[1, P + generated]`` (at most ``max_new_tokens`` new, cut after the first stop token), or a
        :class:`DFlashGeneration` with the per-cycle acceptance lengths when ``return_stats``."""
        self.eval()
        input_ids = _prompt_ids(input_ids)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt: input_ids must be [1, P], got {tuple(input_ids.shape)}")
        if self.mask_token_id is None:
            raise ValueError("config.json has no dflash_config.mask_token_id")
        if int(max_new_tokens) < 1:  # no cycle would run: tau would be undefined
            raise ValueError(f"spec_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        device = input_ids.device
        B, P = self.block_size, input_ids.shape[1]
        max_length = P + max_new_tokens
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        stops = torch.tensor(sorted(set(stop_token_ids or [])), dtype=torch.long, device=device)
        output_ids = torch.full((1, max_length + B), self.mask_token_id, dtype=torch.long, device=device)
        output_ids[:, :P] = input_ids
        positions = torch.arange(max_length + B, device=device).unsqueeze(0)  # [1, P+N+B]

        kv = _cache_keyword(target)
        out = target(input_ids=input_ids, position_ids=positions[:, :P], use_cache=True,
                     output_hidden_states=True, logits_to_keep=1)
        target_cache = getattr(out, kv)
        greedy = temperature < 1e-5
        if greedy:
            output_ids[:, P] = sample(out.logits[:, -1:], temperature)[:, 0]
        else:
            first = warp_probs(out.logits[0, -1], temperature, top_p, top_k)  # [V]
            output_ids[:, P] = int(torch.multinomial(first.cpu(), 1, generator=generator))
        ctx = extract_context_feature(out.hidden_states, self.target_layer_ids)  # [1, P, n*H]
        draft_cache = DynamicCache()
        result = DFlashGeneration(output_ids, P)
        start = P  # position of the last accepted token, the block's first row
        stopped = False  # a stop token as the prefill's token still runs the first cycle (as eval --live, 44947fb)
        while start < max_length and not stopped:  # until more than max_new_tokens tokens exist
            block = output_ids[:, start:start + B].clone()  # [1, B]: [last token, MASK, ...]
            cached = draft_cache.get_seq_length()
            hidden = self(position_ids=positions[:, cached:start + B], noise_embedding=self.embed_block(embed, block),
                          target_hidden=ctx.to(self.device), past_key_values=draft_cache)  # [1, B, H]
            _crop(draft_cache, start)  # keep the context only
            drafts, q = self.draft(hidden[:, 1:], block[:, 0], head, temperature, top_p, top_k, generator)
            block[:, 1:] = drafts.to(device)
            out = target(input_ids=block, position_ids=positions[:, start:start + B], **{kv: target_cache},
                         use_cache=True, output_hidden_states=True)
            if greedy:
                posterior = sample(out.logits, temperature)  # [1, B]: the target's token after each row
                accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
                nxt = int(posterior[0, accepted])
            else:
                p = warp_probs(out.logits[0], temperature, top_p, top_k).cpu()  # [B, V]
                accepted, nxt = speculative_sampling(block[0, 1:].cpu(), q, p, generator)
            output_ids[:, start:start + accepted + 1] = block[:, :accepted + 1]
            output_ids[:, start + accepted + 1] = nxt
            # from ``start``: the first cycle's anchor is the prefill's token, which may be a stop token
            stopped = bool(torch.isin(output_ids[0, start:start + accepted + 2], stops).any())
            start += accepted + 1
            _crop(target_cache, start)
            result.acceptance_lengths.append(accepted + 1)
            ctx = extract_context_feature(out.hidden_states, self.target_layer_ids)[:, :accepted + 1]
        ids = output_ids[:, :min(start + 1, max_length)]
        hits = torch.isin(ids[0, P:], stops).nonzero()
        if hits.numel():
            ids = ids[:, :P + int(hits[0, 0]) + 1]
        result.output_ids = ids
        return result if return_stats else ids


# ----------------------------------------------------------------------------------------------
# DFlash2
# ----------------------------------------------------------------------------------------------


class DFlashGroupedConv(nn.Module):
    """Grouped dynamic causal convolution over the rows of one block (zero before its first row)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def _convolve(self, x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x [B, L, H], taps [B, L, K, G], base [K, H] -> [B, L, H]."""
        Bn, L, H = x.shape
        G = H // self.group_size
        xg = x.view(Bn, L, G, self.group_size)
        out = torch.zeros_like(xg)
        for o in range(min(self.kernel_size, L)):
            prev = F.pad(xg[:, :L - o], (0, 0, 0, 0, o, 0))  # row t sees row t - o of the same block
            out = out + (base[o].view(G, self.group_size).to(x.dtype) + taps[:, :, o, :, None]) * prev
        return out.view(Bn, L, H)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Bn, L, H = x.shape
        taps = self.kernel_projection(x).view(Bn, L, 2, self.kernel_size, H // self.group_size)
        return self._convolve(x, taps[:, :, 0], self.base_kernel[0]), taps[:, :, 1]

    def finish(self, y: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, taps, self.base_kernel[1])


class DFlashCandidateSelector(nn.Module):
    """Low-rank rescoring of the unary top-K with the previous token (tensor names of the reference)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = min(top_k, vocab_size)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [B, L, H], unary logits [B, L, V], anchor_ids [B] -> (tokens [B, L], candidates [B, L, K],
        the sampling distribution over the candidates [B, L, K] when temperature > 0, else None)."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)  # [B, L, K]
        query = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()  # [B, L, r]
        prev = anchor_ids.to(cand.device)
        tokens, dists = [], []
        for row in range(hidden.shape[1]):
            pred = self.predecessor_codebook[prev].float() * query[:, row]  # [B, r]
            succ = self.successor_codebook[cand[:, row]].float()  # [B, K, r]
            scores = unary[:, row] + torch.einsum("br,bkr->bk", pred, succ)  # [B, K]
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                on = q if generator is None or generator.device == q.device else q.cpu()  # spec_generate: CPU
                j = torch.multinomial(on, 1, generator=generator)[:, 0].to(q.device)
                dists.append(q)
            else:
                j = scores.argmax(dim=-1)
            prev = cand[:, row].gather(1, j[:, None])[:, 0]
            tokens.append(prev)
        return torch.stack(tokens, 1), cand, torch.stack(dists, 1) if dists else None


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: DFlash plus the block-local dynamic convolutions and the candidate selector."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dc = dict(getattr(config, "dflash_config", None) or {})
        kernel, group = int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        for layer in self.layers:
            layer.attention_conv = DFlashGroupedConv(config.hidden_size, kernel, group)
            layer.mlp_conv = DFlashGroupedConv(config.hidden_size, kernel, group)
        self.candidate_selector = DFlashCandidateSelector(config.hidden_size, config.vocab_size,
                                                          int(dc["selector_rank"]), int(dc["selector_top_k"]))
        self.post_init()

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, head: nn.Module, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The selector's walk over the rows' hidden [B, L, H] from ``anchor_ids`` [B]: (tokens, candidates,
        the per-row distribution over the candidates when sampling)."""
        return self.candidate_selector.select(hidden, self.compute_logits(hidden, head), anchor_ids, temperature,
                                              generator)

    def draft_tokens(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, head: nn.Module,
                     temperature: float = 0.0) -> torch.Tensor:
        return self.propose(hidden, anchor_ids, head, temperature)[0]

    def draft(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, head: nn.Module, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DFlash2: the selector's walk; when sampling, each row is drawn from softmax(scores / T) over its
        candidates given the row before, and q [L, V] is that distribution on the vocabulary (zero outside the
        candidates). ``top_p`` / ``top_k`` shape the target's side only (lossless for any proposal)."""
        if temperature < 1e-5:
            return self.draft_tokens(hidden, anchor_ids, head), None
        tokens, cand, dists = self.propose(hidden, anchor_ids, head, temperature, generator)  # any generator device
        q = torch.zeros(cand.shape[1], int(head.weight.shape[0])).scatter_(1, cand[0].cpu(), dists[0].float().cpu())
        return tokens, q

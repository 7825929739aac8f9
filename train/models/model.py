"""The DFlash drafter: a small Qwen3-style decoder conditioned on target features.

Parameter names are those of the released DFlash drafters (``fc``, ``hidden_norm``,
``layers.{i}.self_attn.{q,k,v,o}_proj``, ``q_norm``/``k_norm``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``norm``), so exporting is a straight save and
a released drafter loads with ``load_state_dict``. The target's embedding and lm_head are frozen
non-persistent buffers: never trained, never in ``state_dict()``.

Forward, for one batch (its R rows of T tokens flattened into one context of C = R*T positions):

    ctx   = hidden_norm(fc(features))                  # [1, C, H], computed once, shared by layers
    h     = embed([x_a, MASK, ..., MASK] per block)    # [1, A*B, H], one block per anchor
    layer: q = q_norm(q_proj(norm1(h)))                 # queries: block rows only
           k = [k_norm(k_proj(ctx)) ; k_norm(k_proj(norm1(h)))], v likewise   # KV injection
           RoPE at document positions (context positions, p_a + 0..B-1 for the block at anchor a)
    out   = norm(h); logits = out @ lm_head.T           # through the chunked loss (train.models.objective)

Everything runs in the compute dtype of its input (bf16 under autocast): RMSNorm (also under CUDA autocast,
whose op list would run it in fp32) and RoPE keep it, and
with ``activation_checkpointing`` only each layer's input is kept for the backward pass.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_cache.errors import ConfigError, SpecMismatchError
from train.config import ModelConfig

from .attention import AttentionBackend, BlockLayout, WithinBlock, attend, resolve_backend

log = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel"}  # model.arch -> exported architecture
_HF_ONLY_KEYS = {"architectures", "auto_map", "dflash_config", "model_type", "dtype", "torch_dtype"}


_MODEL_DEFAULTS = ModelConfig()  # the config schema holds each default once


@dataclass
class DFlashConfig:
    """The drafter's architecture; ``to_hf_dict()`` is the exported ``config.json``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = _MODEL_DEFAULTS.rms_norm_eps
    rope_theta: float = _MODEL_DEFAULTS.rope_theta
    max_position_embeddings: int = _MODEL_DEFAULTS.max_position_embeddings
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # how sliding_attention / full_attention layers attend within the draft block: "bidirectional" or "causal".
    # Full layers are causal only in a released drafter whose config.json says ``is_causal: true``.
    sliding_within_block: str = "bidirectional"
    full_within_block: str = "bidirectional"
    # the block's token embeddings are multiplied by it (``dflash_config.input_embedding_scale``, as the reference)
    input_embedding_scale: float = 1.0
    attention_bias: bool = False
    # the drafter family and its DFlash2 modules (train.models.dflash2); the logit transform applies to both families
    arch: str = "dflash"
    conv_kernel_size: int = _MODEL_DEFAULTS.conv_kernel_size
    conv_group_size: int = _MODEL_DEFAULTS.conv_group_size
    selector_top_k: int = _MODEL_DEFAULTS.selector_top_k
    selector_rank: int = _MODEL_DEFAULTS.selector_rank
    output_multiplier: float = _MODEL_DEFAULTS.output_multiplier
    final_logit_softcapping: float | None = None
    # Fields of a loaded config.json this product does not interpret (bos/eos ids ...), kept on export.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        problems = []
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2 (one anchor + at least one drafted token), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary [0, {self.vocab_size}); "
                "set model.mask_token_id to a reserved id of the teacher's vocabulary"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if "sliding_attention" in (self.layer_types or []) and not self.sliding_window:
            problems.append("sliding_attention layers need sliding_window > 0")
        for name in ("sliding_within_block", "full_within_block"):
            if getattr(self, name) not in ("bidirectional", "causal"):
                problems.append(f"{name} must be 'bidirectional' or 'causal', got {getattr(self, name)!r}")
        if (self.full_within_block == "causal" and self.sliding_within_block == "bidirectional"
                and "sliding_attention" in (self.layer_types or [])):
            problems.append("full_within_block 'causal' with bidirectional sliding layers: no serving engine's key "
                            "says that (is_causal makes every layer causal); make the sliding layers causal too")
        if not (math.isfinite(self.input_embedding_scale) and self.input_embedding_scale > 0):
            problems.append(f"input_embedding_scale must be a finite number > 0, got {self.input_embedding_scale}")
        if self.arch not in ARCHITECTURES:
            problems.append(f"arch must be one of {sorted(ARCHITECTURES)}, got {self.arch!r}")
        if self.arch == "dflash2" and self.hidden_size % self.conv_group_size:
            problems.append(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}; "
                            "set model.conv_group_size to a divisor of the teacher's hidden size")
        if problems:
            raise ConfigError("invalid drafter config:\n  " + "\n  ".join(problems))

    def layer_type(self, idx: int) -> str:
        return self.layer_types[idx] if self.layer_types else "full_attention"

    def within_block(self, idx: int) -> WithinBlock:
        """The within-block rule of layer ``idx``: its layer type's (``sliding_within_block`` / ``full_within_block``)."""
        rule = self.sliding_within_block if self.layer_type(idx) == "sliding_attention" else self.full_within_block
        return "causal" if rule == "causal" else "bidirectional"

    def causality_keys(self) -> dict[str, bool]:
        """The causality switches a serving engine reads (docs/serving.md), for this drafter's rules: none where
        the engines' default (sliding layers causal, full layers bidirectional) is the rule, else ``is_causal`` and
        ``dflash_config.causal`` (vLLM versions before ``is_causal``) with the one value every layer has."""
        kinds = {self.layer_type(i) for i in range(self.num_hidden_layers)}
        rules = {self.within_block(i) for i in range(self.num_hidden_layers)}
        default = {("causal" if k == "sliding_attention" else "bidirectional") for k in kinds}
        if rules == default:
            return {}
        return {"is_causal": rules == {"causal"}}

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` of an exported drafter, in the released DFlash drafters' layout."""
        layer_types = [self.layer_type(i) for i in range(self.num_hidden_layers)]
        uses_sliding = "sliding_attention" in layer_types
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "auto_map": {"AutoModel": f"dflash.{ARCHITECTURES[self.arch]}"},
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "dtype": "bfloat16",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": layer_types,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": uses_sliding,
            "vocab_size": self.vocab_size,
        }
        if uses_sliding:  # the within-block rule of sliding layers, for the shipped dflash.py
            out["dflash_config"]["sliding_within_block"] = self.sliding_within_block
        for key, value in self.causality_keys().items():  # the switches the serving engines read
            out[key] = value
            out["dflash_config"]["causal"] = value  # vLLM versions that predate is_causal
        if self.input_embedding_scale != 1.0:
            out["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        out["dflash_config"].update(self.family_hf_fields())
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    def family_hf_fields(self) -> dict[str, Any]:
        """The ``dflash_config`` fields of the logit transform and, for DFlash2, its modules (reference names)."""
        out: dict[str, Any] = {}
        if self.output_multiplier != 1.0:
            out["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            out["final_logit_softcapping"] = self.final_logit_softcapping
        if self.arch == "dflash2":
            out.update(block_size=self.block_size, conv_kernel_size=self.conv_kernel_size,
                       conv_group_size=self.conv_group_size, selector_top_k=self.selector_top_k,
                       selector_rank=self.selector_rank)
        return out

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Read a released or exported drafter's ``config.json``."""
        name = (d.get("architectures") or [ARCHITECTURE])[0]
        by_name = {v: k for k, v in ARCHITECTURES.items()}
        if name not in by_name:
            raise ConfigError(f"drafter config.json: architecture {name!r} is not supported; expected one of "
                              f"{sorted(by_name)}")
        dc = d.get("dflash_config") or {}
        rope = d.get("rope_parameters") or {}
        mask_id = dc.get("mask_token_id", d.get("mask_token_id"))
        layer_ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
        missing = [k for k, v in (("dflash_config.mask_token_id", mask_id),
                                  ("dflash_config.target_layer_ids", layer_ids)) if v is None]
        if missing:
            raise ConfigError(f"drafter config.json lacks {', '.join(missing)}")
        refuse_unsupported_fields(d)
        sliding_rule, full_rule = released_within_block(d)
        scale = dc.get("input_embedding_scale", d.get("input_embedding_scale", 1.0))
        known = {f.name for f in cls.__dataclass_fields__.values()}
        extra = {k: v for k, v in d.items() if k not in known and k not in _HF_ONLY_KEYS
                 and k not in _DERIVED_HF_KEYS}
        return cls(
            hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
            block_size=int(dc.get("block_size", d.get("block_size", 16))), mask_token_id=int(mask_id),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=int(d.get("num_target_layers", dc.get("num_target_layers", max(layer_ids) + 3))),
            rms_norm_eps=d.get("rms_norm_eps", _MODEL_DEFAULTS.rms_norm_eps),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", _MODEL_DEFAULTS.rope_theta))),
            max_position_embeddings=d.get("max_position_embeddings", _MODEL_DEFAULTS.max_position_embeddings),
            layer_types=d.get("layer_types"),
            sliding_window=d.get("sliding_window"), attention_bias=bool(d.get("attention_bias", False)),
            sliding_within_block=sliding_rule, full_within_block=full_rule,
            input_embedding_scale=float(scale if scale is not None else 1.0), extra=extra,
            arch=by_name[name], output_multiplier=float(dc.get("output_multiplier", 1.0)),
            final_logit_softcapping=dc.get("final_logit_softcapping"),
            **{k: int(dc[k]) for k in ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")
               if k in dc},
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DFlashConfig:
        return cls(**json.loads(text))


_DERIVED_HF_KEYS = {
    "attention_dropout", "hidden_act", "initializer_range", "max_window_layers", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "use_cache", "use_sliding_window", "transformers_version", "is_causal",
}

# The dflash_config keys this product reads; any other is a switch some DFlash reader may apply and we do not.
_DFLASH_CONFIG_KEYS = {
    "target_layer_ids", "mask_token_id", "block_size", "num_target_layers", "sliding_within_block", "causal",
    "input_embedding_scale", "output_multiplier", "final_logit_softcapping", "conv_kernel_size", "conv_group_size",
    "selector_top_k", "selector_rank",
}
# Fields a serving engine reads for some drafters that this product does not implement, with their neutral values
# (a config holding one of those values means what it would without the field), as the engines read them
# (docs/serving.md): ``attention_sink_bias`` adds a learned per-head sink logit to every softmax (SGLang
# speculative/dflash_utils.py, vLLM models/qwen3_dflash.py, which also takes the top-level
# ``add_swa_attention_sink_bias``); ``attention_value_scale`` multiplies V before attention (SGLang
# dflash_utils.py, as MiMo's attention does); ``swa_window_size`` is the sliding layers' window, taken by vLLM
# before ``sliding_window`` (so it is neutral where it equals ``sliding_window`` or no layer slides: see
# ``refuse_unsupported_fields``); ``is_neox_style`` false rotates interleaved pairs (vLLM, SGLang), where this
# drafter rotates halves; ``logit_scale`` multiplies vLLM's draft logits.
UNSUPPORTED_ENGINE_FIELDS: dict[str, tuple[Any, ...]] = {
    "attention_sink_bias": (None, False),
    "add_swa_attention_sink_bias": (None, False),
    "attention_value_scale": (None, 1.0),
    "swa_window_size": (None,),
    "is_neox_style": (None, True),
    "rope_is_neox_style": (None, True),
    "logit_scale": (None, 1.0),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def refuse_unsupported_fields(d: dict[str, Any]) -> None:
    """A released ``config.json`` must not ask for what the drafter here does not compute: name every such field
    (an engine field with a non-neutral value, an unknown ``dflash_config`` key, a layer type or RoPE type other
    than the drafter's) instead of training a different model than the one that is served."""
    dc = d.get("dflash_config") or {}
    problems = []
    window_neutral = (None, d.get("sliding_window")) if "sliding_attention" in (d.get("layer_types") or []) else None
    for name, neutral in UNSUPPORTED_ENGINE_FIELDS.items():
        for where, value in ((name, d.get(name)), (f"dflash_config.{name}", dc.get(name))):
            if name == "swa_window_size" and (window_neutral is None or value in window_neutral):
                continue  # the window the sliding layers have anyway, or no sliding layer to read it
            if not any(value is n or (n is not None and value == n and not isinstance(value, bool)) for n in neutral):
                problems.append(f"{where} = {json.dumps(value)} (not implemented here)")
    problems += [f"dflash_config.{k} (unknown to this trainer)" for k in sorted(set(dc) - _DFLASH_CONFIG_KEYS)
                 if k not in UNSUPPORTED_ENGINE_FIELDS]
    problems += [f"layer_types entry {t!r} (expected {' or '.join(_LAYER_TYPES)})"
                 for t in sorted(set(d.get("layer_types") or [])) if t not in _LAYER_TYPES]
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if kind != "default":
            problems.append(f"{key} type {kind!r} (only the default RoPE is implemented)")
    if problems:
        raise ConfigError("drafter config.json asks for what this trainer does not implement: " + "; ".join(problems)
                          + "; a drafter trained without it would not be the one the engines serve")


def _reader_rules(flag: Any) -> dict[str, str]:
    """The within-block rule per layer type under one causality switch: absent = the engines' default (sliding
    layers causal, full layers bidirectional), true / false = every layer causal / bidirectional."""
    return {"sliding_attention": "bidirectional" if flag is False else "causal",
            "full_attention": "causal" if flag else "bidirectional"}


def released_within_block(d: dict[str, Any]) -> tuple[str, str]:
    """``(sliding rule, full rule)`` of a drafter ``config.json`` as its readers apply it (docs/serving.md): the DFlash
    reference (dflash 0.1.0) and SGLang read the top-level ``is_causal``, vLLM ``is_causal`` else
    ``dflash_config.causal``; without either, sliding layers are causal and full layers bidirectional. So when both
    keys are given and differ, ``is_causal`` decides (every engine that reads it reads it first; only vLLM versions
    from before it read ``dflash_config.causal``): a warning names both, and an export writes them agreeing. A config
    the readers would read differently, or whose ``dflash_config.sliding_within_block`` (this product's key) says
    otherwise than they do, is refused: which rule it was trained with cannot be known."""
    dc = d.get("dflash_config") or {}
    is_causal, causal = d.get("is_causal"), dc.get("causal")
    for name, value in (("is_causal", is_causal), ("dflash_config.causal", causal)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"drafter config.json: {name} = {value!r}; expected true, false or no key")
    kinds = set(d.get("layer_types") or ["full_attention"])
    if is_causal is not None and causal is not None and is_causal != causal:
        log.warning("drafter config.json: is_causal = %s and dflash_config.causal = %s: is_causal decides (the DFlash "
                    "reference, SGLang and vLLM read it first), so every layer is %s within the block; vLLM versions "
                    "that read only dflash_config.causal would serve it otherwise; an export writes both keys as %s "
                    "(or neither, where that rule is the engines' default)", str(is_causal).lower(), str(causal).lower(),
                    "causal" if is_causal else "bidirectional", str(is_causal).lower())
    reference = {k: v for k, v in _reader_rules(is_causal).items() if k in kinds}
    vllm = {k: v for k, v in _reader_rules(is_causal if is_causal is not None else causal).items() if k in kinds}
    if reference != vllm:
        raise ConfigError(
            f"drafter config.json: dflash_config.causal = {str(causal).lower()} without is_causal: the DFlash reference "
            f"and SGLang read its layers as {reference}, vLLM as {vllm}; add is_causal (true or false: the rule the "
            "drafter was trained with), which every reader takes first")
    ours = dc.get("sliding_within_block")
    if ours is not None and "sliding_attention" in kinds and ours != reference["sliding_attention"]:
        raise ConfigError(
            f"drafter config.json: dflash_config.sliding_within_block = {ours!r}, but is_causal = "
            f"{'absent' if is_causal is None else str(is_causal).lower()} makes the serving engines run sliding layers "
            f"{reference['sliding_attention']}; make the two agree (is_causal: false is the bidirectional rule)")
    return reference.get("sliding_attention", "bidirectional"), reference.get("full_attention", "bidirectional")


def unservable_layers(cfg: DFlashConfig) -> list[int]:
    """Target layer ids SGLang cannot capture: its Qwen3 capture stops before the teacher's last layer."""
    return [i for i in cfg.target_layer_ids if i >= cfg.num_target_layers - 1]


def warn_unservable_layers(cfg: DFlashConfig, where: str) -> None:
    """Warn when ``cfg`` reads the teacher's last layer, which SGLang never captures (docs/serving.md)."""
    bad = unservable_layers(cfg)
    if bad:
        log.warning("%s: target_layer_ids %s include the teacher's last layer (%d of %d layers); SGLang's capture never "
                    "reaches it, so SGLang cannot serve this drafter (transformers and vLLM can); choose layers below "
                    "%d to serve with SGLang", where, bad, cfg.num_target_layers - 1, cfg.num_target_layers,
                    cfg.num_target_layers - 1)


# The serving engines that feed a drafter's block embeddings unscaled, per family (docs/serving.md): SGLang's
# DFlash config parser (speculative/dflash_utils.py) does not read input_embedding_scale for either family, vLLM
# applies it in qwen3_dflash2.py (DFlash2) but not in qwen3_dflash.py (DFlash).
ENGINES_IGNORING_INPUT_SCALE = {"dflash": "SGLang and vLLM", "dflash2": "SGLang"}


def warn_unserved_input_scale(cfg: DFlashConfig, where: str) -> None:
    """Warn when ``cfg`` scales its block embeddings and an engine serving its family would not."""
    engines = ENGINES_IGNORING_INPUT_SCALE.get(cfg.arch)
    if cfg.input_embedding_scale != 1.0 and engines:
        log.warning("%s: dflash_config.input_embedding_scale = %g is not applied by %s (the block's embeddings "
                    "are fed unscaled), so this %s drafter would be served as a different model from the one "
                    "trained (transformers' dflash.py and the DFlash reference apply it); see docs/serving.md",
                    where, cfg.input_embedding_scale, engines, ARCHITECTURES[cfg.arch])


def warn_serving_limits(cfg: DFlashConfig, where: str) -> None:
    """Every serving-engine warning for ``cfg``: layers SGLang cannot capture, an input scale an engine ignores."""
    warn_unservable_layers(cfg, where)
    warn_unserved_input_scale(cfg, where)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


class _RMSNormFn(torch.autograd.Function):
    """x [..., D] -> (x * rsqrt(mean(x^2) + eps) * weight) in x's dtype, computed in fp32 a slice of rows at a
    time (its fp32 temporaries stay small whatever the rows: a fused kernel's memory, on every device); saves
    only x and the fp32 rstd [rows, 1] for backward."""

    CHUNK_ELEMENTS = 1 << 24  # elements per slice: ~64 MB per fp32 temporary

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        D = x.shape[-1]
        rows = x.reshape(-1, D)  # [R, D]
        out = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)  # [R, 1]
        step = max(1, _RMSNormFn.CHUNK_ELEMENTS // D)
        for s in range(0, rows.shape[0], step):
            xf = rows[s:s + step].float()
            rstd[s:s + step] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            out[s:s + step] = xf * rstd[s:s + step] * weight
        ctx.save_for_backward(x, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        # y = x_hat * w with x_hat = x * rstd: dx = rstd * (g*w - x_hat * mean(g*w * x_hat)), dw = sum(g * x_hat)
        x, weight, rstd = ctx.saved_tensors
        D = x.shape[-1]
        rows, grows = x.reshape(-1, D), grad.reshape(-1, D)  # [R, D]
        grad_x = torch.empty_like(rows)
        grad_w = torch.zeros(D, dtype=torch.float32, device=x.device)
        step = max(1, _RMSNormFn.CHUNK_ELEMENTS // D)
        for s in range(0, rows.shape[0], step):
            r = rstd[s:s + step]  # [c, 1]
            x_hat = rows[s:s + step].float() * r
            g = grows[s:s + step].float()
            grad_w += (g * x_hat).sum(0)
            gw = g * weight
            grad_x[s:s + step] = r * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
        return grad_x.view(x.shape), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalised in fp32 inside; the output keeps ``x``'s dtype whatever autocast's op lists say.

        CUDA autocast runs ``rms_norm`` in fp32 since torch 2.12: under it every norm output (the residual
        stream, q/k, the loss head's input) would become fp32 and double those activations. So the norm runs
        with autocast off, in the dtype of its input, which is the compute dtype the config chose
        (``train.precision``); backward keeps only the input and one fp32 scale per row."""
        if not _autocast_on(x.device):
            return _RMSNormFn.apply(x, self.weight.to(x.dtype), self.eps)
        with torch.autocast(x.device.type, enabled=False):
            return _RMSNormFn.apply(x, self.weight.to(x.dtype), self.eps)


class RotaryEmbedding(nn.Module):
    """Qwen3 (NeoX-style, default rope type) rotary embedding; inv_freq is not persistent."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [L] -> cos, sin [1, 1, L, D], computed in float32 and returned in ``dtype``."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()  # [L, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [L, D]
        return emb.cos().to(dtype).view(1, 1, *emb.shape), emb.sin().to(dtype).view(1, 1, *emb.shape)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [1, heads, L, D]; cos/sin [1, 1, L, D] in x's dtype."""
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.within_block = cfg.within_block(layer_idx)
        self.window = cfg.sliding_window if cfg.layer_type(layer_idx) == "sliding_attention" else None

    def _heads(self, x: Tensor, n: int) -> Tensor:
        _, L, _ = x.shape
        return x.view(1, L, n, self.head_dim)

    def _keys(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """x [1, L, H] -> k, v [1, Hkv, L, d] (k normed and rotated)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(
        self, h: Tensor, ctx: Tensor, rope_q: tuple[Tensor, Tensor], rope_ctx: tuple[Tensor, Tensor],
        layout: BlockLayout, backend: AttentionBackend,
    ) -> Tensor:
        """h [1, Q, H] (normed block rows), ctx [1, C, H] (fused context) -> [1, Q, H]."""
        _, Q, _ = h.shape
        q = self.q_norm(self._heads(self.q_proj(h), self.num_heads)).transpose(1, 2)  # [1, Hq, Q, d]
        q = apply_rope(q, *rope_q)
        # KV injection: the context and the block rows go through the same projections; projecting them
        # separately keeps only [C, H] (shared by every layer) and [Q, H] as saved inputs, not a [C+Q, H] copy
        k_ctx, v_ctx = self._keys(ctx, rope_ctx)  # [1, Hkv, C, d]
        k_blk, v_blk = self._keys(h, rope_q)  # [1, Hkv, Q, d]
        k = torch.cat([k_ctx, k_blk], dim=2)  # [1, Hkv, C+Q, d]
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = attend(q, k, v, layout, within_block=self.within_block, window=self.window, backend=backend,
                     scale=1.0 / math.sqrt(self.head_dim))  # [1, Hq, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(1, Q, -1))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DFlash2: block-local dynamic convolutions around each sublayer (train.models.dflash2); None for DFlash
        self.attention_conv: nn.Module | None = None
        self.mlp_conv: nn.Module | None = None

    def forward(self, h: Tensor, ctx: Tensor, rope_q: Any, rope_k: Any, layout: BlockLayout,
                backend: AttentionBackend) -> Tensor:
        if self.attention_conv is not None and self.mlp_conv is not None:
            B = layout.block_size
            x, after = self.attention_conv.prepare(self.input_layernorm(h), B)
            h = h + self.attention_conv.finish(self.self_attn(x, ctx, rope_q, rope_k, layout, backend), after, B)
            x, after = self.mlp_conv.prepare(self.post_attention_layernorm(h), B)
            return h + self.mlp_conv.finish(self.mlp(x), after, B)
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_k, layout, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, embed_tokens: Tensor, lm_head: Tensor, attention: str = "auto",
                 activation_checkpointing: bool = False):
        super().__init__()
        self.config = cfg
        self.attention = attention
        self.activation_checkpointing = activation_checkpointing
        n = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        _check_head(cfg, embed_tokens, lm_head)
        # Frozen target head: buffers (moved by .to(), never optimized), not persistent (never saved).
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def embed(self, ids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """ids [...] -> [..., H] in ``dtype`` (default: the parameters' dtype), times ``input_embedding_scale``."""
        x = F.embedding(ids, self.embed_tokens)
        if self.config.input_embedding_scale != 1.0:  # as the reference scales its noise embedding
            x = x * self.config.input_embedding_scale
        return x.to(dtype or self.fc.weight.dtype)

    def fuse_context(self, features: Tensor) -> Tensor:
        """features [R, T, n*H] (bf16 from the cache) -> fused context [R, T, H]."""
        if features.shape[-1] != self.fc.in_features:
            raise SpecMismatchError(
                f"features have width {features.shape[-1]} but the drafter expects "
                f"{self.fc.in_features} = {len(self.config.target_layer_ids)} layers x {self.config.hidden_size}",
                fields=["hidden_size", "target_layer_ids"],
            )
        x = features if _autocast_on(features.device) else features.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def forward(self, features: Tensor, block_ids: Tensor, block_positions: Tensor, layout: BlockLayout) -> Tensor:
        """features [R, T, n*H], block_ids [A, B], block_positions [A, B] (document positions) ->
        final hidden states of the block rows [A, B, H]. Context positions come from ``layout.ctx_pos``."""
        A, B = block_ids.shape
        backend = resolve_backend(self.attention, features.device)
        ctx = self.fuse_context(features).reshape(1, -1, self.config.hidden_size)  # [1, C, H]
        h = self.embed(block_ids.reshape(1, A * B), ctx.dtype)  # [1, A*B, H]
        rope_q = self.rotary_emb(block_positions.reshape(A * B), ctx.dtype)  # [1, 1, A*B, d]
        rope_ctx = self.rotary_emb(layout.ctx_pos, ctx.dtype)  # [1, 1, C, d]
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:  # keep only the layer's input; recompute its inside during backward
                h = checkpoint(layer, h, ctx, rope_q, rope_ctx, layout, backend, use_reentrant=False,
                               preserve_rng_state=False)
            else:
                h = layer(h, ctx, rope_q, rope_ctx, layout, backend)
        return self.norm(h).view(A, B, -1)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> unary logits [..., V] through the frozen target lm_head (and the configured
        ``output_multiplier`` / ``final_logit_softcapping``)."""
        w = self.lm_head
        if not _autocast_on(hidden.device):
            w = w.to(hidden.dtype)
        return self.logit_transform(F.linear(hidden, w))

    def logit_transform(self, logits: Tensor) -> Tensor:
        """The unary logit transform: ``* output_multiplier``, then ``cap * tanh(. / cap)`` when a cap is set."""
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            cap = float(cfg.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits


def _autocast_on(device: torch.device) -> bool:
    """Whether autocast is active for ``device`` (never for devices autocast does not know, e.g. meta)."""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:
        return False


def _check_head(cfg: DFlashConfig, embed_tokens: Tensor, lm_head: Tensor) -> None:
    expected = (cfg.vocab_size, cfg.hidden_size)
    for name, t in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
        if tuple(t.shape) != expected:
            raise SpecMismatchError(
                f"target {name} has shape {tuple(t.shape)}, the drafter expects {expected} "
                "(vocab_size, hidden_size); the head must come from the cache the drafter is trained on",
                fields=["vocab_size" if t.shape[0] != cfg.vocab_size else "hidden_size"],
            )


# ----------------------------------------------------------------------------------------------
# Building from the config + cache spec
# ----------------------------------------------------------------------------------------------


def resolve_mask_token_id(model_cfg: Any, spec: Any) -> int:
    """The mask token recorded in the cache ``spec`` at extraction; ``model.mask_token_id``, when set,
    must equal it. Caches written before it was recorded need ``model.mask_token_id``."""
    cached, wanted = getattr(spec, "mask_token_id", None), model_cfg.mask_token_id
    if cached is None:
        if wanted is None:
            raise ConfigError(
                "the cache does not record a mask token (it predates mask-token recording) and model.mask_token_id "
                "is not set; set model.mask_token_id to the reserved id the drafter should use (Qwen3: 151669), "
                "or re-extract the cache"
            )
        return int(wanted)
    if wanted is not None and int(wanted) != int(cached):
        source = getattr(spec, "mask_token_source", None) or "extraction"
        raise SpecMismatchError(
            f"model.mask_token_id = {wanted}, but the cache was extracted with mask_token_id {cached} (from the "
            f"{source}); drop model.mask_token_id to use the cache's, or re-extract with {wanted}",
            fields=["mask_token_id"],
        )
    return int(cached)


def drafter_config(model_cfg: Any, spec: Any) -> DFlashConfig:
    """The drafter architecture for ``model_cfg`` (the ``model`` config section) on the cache ``spec``."""
    teacher = spec.teacher
    return DFlashConfig(
        hidden_size=int(teacher.hidden_size), num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads, num_key_value_heads=model_cfg.num_key_value_heads,
        head_dim=model_cfg.head_dim, intermediate_size=model_cfg.intermediate_size,
        vocab_size=int(teacher.vocab_size), block_size=model_cfg.block_size,
        mask_token_id=resolve_mask_token_id(model_cfg, spec),
        target_layer_ids=[int(i) for i in spec.target_layer_ids], num_target_layers=int(teacher.num_layers),
        rms_norm_eps=model_cfg.rms_norm_eps, rope_theta=model_cfg.rope_theta,
        max_position_embeddings=model_cfg.max_position_embeddings,
        layer_types=list(model_cfg.layer_types) if model_cfg.layer_types else None,
        sliding_window=model_cfg.sliding_window, sliding_within_block=model_cfg.sliding_within_block,
        arch=model_cfg.arch, conv_kernel_size=model_cfg.conv_kernel_size, conv_group_size=model_cfg.conv_group_size,
        selector_top_k=model_cfg.selector_top_k, selector_rank=model_cfg.selector_rank,
        output_multiplier=model_cfg.output_multiplier, final_logit_softcapping=model_cfg.final_logit_softcapping,
    )


def check_compatible(found: DFlashConfig, expected: DFlashConfig, source: str) -> None:
    """A drafter (checkpoint / released dir) must match the cache it is used with; name every field that does not."""
    fields = ["arch", "hidden_size", "target_layer_ids", "vocab_size", "block_size", "mask_token_id",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"]
    cache_fields = {"hidden_size", "target_layer_ids", "vocab_size"}
    diffs = [f for f in fields if getattr(found, f) != getattr(expected, f)]
    bad_cache = [f for f in diffs if f in cache_fields]
    if bad_cache:
        detail = "; ".join(f"{f}: drafter {getattr(found, f)} vs cache {getattr(expected, f)}" for f in bad_cache)
        raise SpecMismatchError(
            f"{source} was built for another target than this cache ({detail}); use a cache extracted from the "
            "same teacher with the same layers, or re-extract with cache.target_layer_ids set to the drafter's",
            fields=bad_cache,
        )
    if diffs:
        log.warning("%s differs from the config in %s; the drafter's own values are used", source, ", ".join(diffs))


# ----------------------------------------------------------------------------------------------
# Weights on disk (safetensors only: no pickle)
# ----------------------------------------------------------------------------------------------

METADATA_KEY = "dflash_config"


def drafter_state(model: DFlashDrafter) -> dict[str, Tensor]:
    """The drafter's own weights (no embedding / lm_head), contiguous, under the released names."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def save_drafter_weights(model: DFlashDrafter, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """``model.safetensors`` with the drafter config in its metadata (so a checkpoint is self-describing)."""
    from safetensors.torch import save_file

    state = to_contract_names(drafter_state(model))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    save_file(state, str(path), metadata={"format": "pt", METADATA_KEY: model.config.to_json()})


def load_drafter_weights(model: DFlashDrafter, path: str | Path) -> None:
    """Load released/exported/checkpoint weights; names and shapes must match exactly."""
    from safetensors.torch import load_file

    state = from_contract_names(load_file(str(path)))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if wrong:
            parts.append("shape " + ", ".join(f"{k}: file {found[k]} vs model {expected[k]}" for k in wrong[:5]))
        raise SpecMismatchError(f"{path}: weights do not fit this drafter: " + "; ".join(parts),
                                fields=["weights"])
    model.load_state_dict({k: v.to(model.fc.weight.dtype) for k, v in state.items()})


# The reference's DFlash2 checkpoints store the selector's codebooks without the ``.weight`` suffix.
CONTRACT_TENSOR_NAMES = {f"candidate_selector.{n}.weight": f"candidate_selector.{n}"
                         for n in ("predecessor_codebook", "successor_codebook")}


def to_contract_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Module names -> the tensor names of a released drafter's ``model.safetensors``."""
    return {CONTRACT_TENSOR_NAMES.get(k, k): v for k, v in state.items()}


def from_contract_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A released drafter's tensor names -> module names (module names pass through unchanged)."""
    back = {v: k for k, v in CONTRACT_TENSOR_NAMES.items()}
    return {back.get(k, k): v for k, v in state.items()}


def read_weights_config(path: str | Path) -> DFlashConfig | None:
    """The drafter config stored in a ``model.safetensors``'s metadata, if any."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return DFlashConfig.from_json(meta[METADATA_KEY]) if METADATA_KEY in meta else None


def read_drafter_config(directory: str | Path) -> DFlashConfig:
    """The config of an exported or released drafter directory (``config.json`` + ``model.safetensors``)."""
    d = Path(directory)
    cfg_path, weights = d / "config.json", d / "model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise ConfigError(f"{d} is not a drafter directory: {p.name} is missing (expected config.json + model.safetensors)")
    if (d / "mask_embedding.pt").exists():  # vLLM substitutes it for the mask token's embedding; this drafter cannot
        raise ConfigError(f"{d / 'mask_embedding.pt'}: a separate mask embedding (vLLM uses it for the mask token) is "
                          "not implemented here; a drafter trained without it would not be the one vLLM serves")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{cfg_path}: not a readable JSON file ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return DFlashConfig.from_hf_dict(raw)
    except ConfigError as err:  # name the file, on one line: a released directory is the user's input
        raise ConfigError(f"{cfg_path}: " + " ".join(line.strip() for line in str(err).splitlines())) from None
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{cfg_path}: not a DFlash drafter config ({type(err).__name__}: {err}); expected the "
                          "released layout (hidden_size, num_hidden_layers, num_attention_heads, ...)") from None

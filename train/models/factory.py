"""The drafter factory: the module class of a drafter config, and drafters built from a config or a directory.

It is the one place that knows every drafter family (``model.arch``): ``model`` defines DFlash and the config,
``dflash2`` extends them, and this module imports both, so neither family module imports the other's
dependants (no import circle inside ``train.models``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import Tensor

from dflash_cache.errors import ConfigError

from .dflash2 import DFlash2Drafter
from .model import (
    DFlashConfig,
    DFlashDrafter,
    check_compatible,
    drafter_config,
    load_drafter_weights,
    read_drafter_config,
    warn_serving_limits,
)

log = logging.getLogger(__name__)

DRAFTER_CLASSES: dict[str, type[DFlashDrafter]] = {"dflash": DFlashDrafter, "dflash2": DFlash2Drafter}


def drafter_class(cfg: DFlashConfig) -> type[DFlashDrafter]:
    """The drafter module of ``cfg.arch``."""
    return DRAFTER_CLASSES[cfg.arch]


def build_drafter(model_cfg: Any, spec: Any, head: tuple[Tensor, Tensor]) -> DFlashDrafter:
    """A fresh drafter (or ``model_cfg.init_from``'s released weights) for the cache ``spec``.

    ``head`` is ``(embed_tokens [V, H], lm_head [V, H])`` from ``cache.load_head()``. A released drafter keeps
    its own config (its attention rule and input scale as its ``config.json`` says, read as the reference reads
    it: :meth:`DFlashConfig.from_hf_dict`)."""
    cfg = drafter_config(model_cfg, spec)
    if model_cfg.init_from:
        released = read_drafter_config(model_cfg.init_from)
        check_compatible(released, cfg, source=str(model_cfg.init_from))
        check_released_matches_model_section(released, cfg, source=str(model_cfg.init_from))
        cfg = released
    warn_serving_limits(cfg, "the drafter config")
    model = drafter_class(cfg)(cfg, head[0], head[1], attention=model_cfg.attention,
                               activation_checkpointing=model_cfg.activation_checkpointing)
    if model_cfg.init_from:
        load_drafter_weights(model, Path(model_cfg.init_from) / "model.safetensors")
        log.info("initialised the drafter from %s", model_cfg.init_from)
    return model


# ``model.*`` keys a released drafter must agree with: the run's config then says what is trained (the loader
# sizes its blocks by model.block_size, ``estimate`` reads the shapes, a resume rebuilds from it). The within-block
# rule and the input scale are the released config.json's own (read as the reference reads it), so they are not
# compared; nor is max_position_embeddings, which no computation here reads.
_MODEL_KEYS = ("arch", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "block_size", "mask_token_id", "rms_norm_eps", "rope_theta", "layer_types",
               "sliding_window", "output_multiplier", "final_logit_softcapping")
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")


def _model_value(cfg: DFlashConfig, key: str) -> Any:
    if key == "layer_types":  # unset means every layer full attention
        return [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)]
    if key == "sliding_window" and "sliding_attention" not in _model_value(cfg, "layer_types"):
        return None  # no layer reads it
    return getattr(cfg, key)


def check_released_matches_model_section(released: DFlashConfig, configured: DFlashConfig, source: str) -> None:
    """A released drafter (``model.init_from``) whose shapes or settings differ from the ``model`` section is
    refused, naming each ``model.*`` key and the value to set: training it under a config that says otherwise
    would size blocks, estimates and resumes for another drafter."""
    keys = _MODEL_KEYS + (_DFLASH2_KEYS if "dflash2" in (released.arch, configured.arch) else ())
    diffs = [(k, _model_value(released, k), _model_value(configured, k)) for k in keys
             if _model_value(released, k) != _model_value(configured, k)]
    if diffs:
        sets = " ".join(f"--set model.{k}={_toml_value(r)}" if r is not None else f"no model.{k}"
                        for k, r, _ in diffs)
        detail = "; ".join(f"model.{k} is {_toml_value(c)}, the drafter's is {_toml_value(r)}" for k, r, c in diffs)
        raise ConfigError(f"model.init_from {source}/config.json does not match the model section ({detail}); "
                          f"set the drafter's values ({sets}) or drop model.init_from")


def _toml_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list):
        return "[" + ",".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def load_drafter_dir(directory: str | Path, head: tuple[Tensor, Tensor], attention: str = "auto") -> DFlashDrafter:
    """Load an exported or released drafter directory with the given frozen target head."""
    cfg = read_drafter_config(directory)
    model = drafter_class(cfg)(cfg, head[0], head[1], attention=attention)
    load_drafter_weights(model, Path(directory) / "model.safetensors")
    return model

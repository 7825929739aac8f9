"""The drafter factory: the module class of a drafter config, and drafters built from a config or a directory.

It is the one place that knows every drafter family (``model.arch``): ``model`` defines DFlash and the config,
``dflash2`` extends them, and this module imports both, so neither family module imports the other's
dependants (no import circle inside ``train.models``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import Tensor

from .dflash2 import DFlash2Drafter
from .model import (
    DFlashConfig,
    DFlashDrafter,
    check_compatible,
    drafter_config,
    load_drafter_weights,
    read_drafter_config,
    warn_unservable_layers,
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
        cfg = released
    warn_unservable_layers(cfg, "the drafter config")
    model = drafter_class(cfg)(cfg, head[0], head[1], attention=model_cfg.attention,
                               activation_checkpointing=model_cfg.activation_checkpointing)
    if model_cfg.init_from:
        load_drafter_weights(model, Path(model_cfg.init_from) / "model.safetensors")
        log.info("initialised the drafter from %s", model_cfg.init_from)
    return model


def load_drafter_dir(directory: str | Path, head: tuple[Tensor, Tensor], attention: str = "auto") -> DFlashDrafter:
    """Load an exported or released drafter directory with the given frozen target head."""
    cfg = read_drafter_config(directory)
    model = drafter_class(cfg)(cfg, head[0], head[1], attention=attention)
    load_drafter_weights(model, Path(directory) / "model.safetensors")
    return model

"""The optimizer choices (``train.optimizer``) behind one ``torch.optim.Optimizer`` interface.

- ``adamw``: one AdamW over every trainable parameter (the reference recipe).
- ``muon``: ``torch.optim.Muon`` for the drafter's 2-D weight matrices (attention q/k/v/o, MLP gate/up/down,
  ``fc``), which is all Muon accepts, and AdamW for the rest (RMSNorm weights, biases if any), each with its
  own learning rate. The frozen embedding and lm_head are buffers, never trained.

:class:`CombinedOptimizer` holds the two as named parts: one ``step`` / ``zero_grad`` / ``state_dict`` /
``load_state_dict``, and ``param_groups`` that *are* the parts' own group dicts, so a learning-rate
scheduler built on it drives both (each group from its own peak lr) and ``train_step`` stays the same for
either choice. A guard-skipped step calls no ``step``: every part's state (AdamW moments, Muon momentum)
stays bitwise unchanged. The checkpoint holds each part's state under its name. State size: AdamW two fp32
moments per parameter, Muon one fp32 momentum buffer (``train.tools.estimate.optimizer_state_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from dflash_cache.errors import DFlashError


def is_muon_matrix(p: Tensor) -> bool:
    """The parameters ``train.optimizer = "muon"`` hands to Muon: trainable 2-D weight matrices."""
    return p.requires_grad and p.ndim == 2


class CombinedOptimizer(torch.optim.Optimizer):
    """Named optimizers over disjoint parameters, stepped as one (see the module docstring)."""

    def __init__(self, parts: Mapping[str, torch.optim.Optimizer]):
        params = [p for opt in parts.values() for g in opt.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.parts = dict(parts)
        self._share_groups()

    def _share_groups(self) -> None:
        # the parts' own group dicts: a scheduler writing group["lr"] here writes it where each part reads it
        # (a part's load_state_dict replaces its dicts, so this runs again after every load)
        self.param_groups = [g for opt in self.parts.values() for g in opt.param_groups]

    @property  # type: ignore[override]
    def state(self) -> dict[Tensor, Any]:
        """Every part's per-parameter state (read-only view; the parameters are disjoint)."""
        return {p: s for opt in self.parts.values() for p, s in opt.state.items()}

    @state.setter
    def state(self, value: Any) -> None:
        if value:  # Optimizer.__init__ assigns an empty state; the parts own theirs
            raise AttributeError("CombinedOptimizer.state is read-only: each part keeps its own")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("CombinedOptimizer.step takes no closure")
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        if sorted(state_dict) != sorted(self.parts):
            raise ValueError(f"optimizer state has parts {sorted(state_dict)}, this optimizer {sorted(self.parts)}")
        for name, opt in self.parts.items():
            opt.load_state_dict(state_dict[name])
        self._share_groups()


def optimizer_parts(optimizer_or_state: Any) -> list[str]:
    """The named optimizers behind an optimizer or its state dict: ``["adamw"]`` for one AdamW
    (``train.optimizer = "adamw"``), ``["muon", "adamw"]`` for ``"muon"``."""
    if isinstance(optimizer_or_state, CombinedOptimizer):
        return list(optimizer_or_state.parts)
    if isinstance(optimizer_or_state, Mapping) and "param_groups" not in optimizer_or_state:
        return list(optimizer_or_state)
    return ["adamw"]


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], where: str) -> None:
    """Refuse to load an optimizer state written under another ``train.optimizer`` (a changed config is
    refused before this unless ``checkpoint.allow_config_change``; even then the state cannot carry over)."""
    have, saved_parts = optimizer_parts(optimizer), optimizer_parts(saved)
    if have != saved_parts:
        raise DFlashError(
            f"checkpoint {where} holds the state of optimizer(s) {'+'.join(saved_parts)}, but this run builds "
            f"{'+'.join(have)}; that state cannot be carried to another train.optimizer (not even with "
            "checkpoint.allow_config_change): resume with the one it was trained with, or start a new --run-dir "
            "(model.init_from an export of this run keeps the weights)"
        )

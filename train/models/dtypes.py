"""The drafter's compute dtypes, checked without a GPU.

CUDA autocast runs some ops in fp32 whatever their inputs (``rms_norm`` since torch 2.12, ``layer_norm``,
``group_norm``); CPU autocast runs the same ops in bf16. :func:`cuda_autocast_rules_on_cpu` gives CPU
autocast CUDA's rule for them, so a CPU test sees what a GPU run would. :class:`DtypeProbe` records the
dtypes that reach the places where a promoted dtype costs memory: the fused context, the residual stream,
the attention's q/k/v and the loss head's operands.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

# ops that CUDA autocast runs in fp32 (its "fp32" cast policy) and that CPU autocast runs in bf16
CUDA_FP32_NORMS = ("rms_norm", "layer_norm", "group_norm")


def _fp32_kernel(op_name: str) -> Any:
    op = getattr(torch.ops.aten, op_name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        def up(a: Any) -> Any:
            return a.float() if isinstance(a, Tensor) and a.is_floating_point() else a

        with torch.autocast("cpu", enabled=False):  # as CUDA's fp32 policy: cast, then run without autocast
            return op(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})

    return kernel


@contextmanager
def cuda_autocast_rules_on_cpu(ops: tuple[str, ...] = CUDA_FP32_NORMS) -> Iterator[None]:
    """Within the block, CPU autocast runs ``ops`` in fp32 (fp32 outputs), as CUDA autocast does."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        for name in ops:
            lib.impl(name, _fp32_kernel(name), "AutocastCPU")
    try:
        yield
    finally:
        del lib  # the registrations go with the library object: CPU autocast's own rule is back


class DtypeProbe:
    """Records the dtypes reaching the drafter's memory-relevant places while the block runs.

    ``seen``: place -> sorted dtype names; places: ``context`` (the fused context), ``residual`` (the block
    rows' hidden states entering and leaving every layer), ``attention_q/k/v`` (the attention kernel's
    inputs), ``final_norm`` (the hidden states entering the loss head), ``loss_head_hidden`` /
    ``loss_head_weight`` (the loss head's operands) and ``loss_head_weight_copied`` (whether the lm_head
    was copied to another dtype)."""

    def __init__(self, model: Any):
        self.model = model
        self.seen: dict[str, set[str]] = {}
        self._undo: list[Any] = []

    def _see(self, place: str, value: Any) -> None:
        self.seen.setdefault(place, set()).add(str(value).replace("torch.", ""))

    def __enter__(self) -> DtypeProbe:
        import train.models.dflash2 as dflash2_mod  # imports head_operands by name: probed there too
        import train.models.model as model_mod
        import train.models.objective as objective_mod

        m = self.model
        hooks = [m.hidden_norm.register_forward_hook(lambda _m, _i, out: self._see("context", out.dtype)),
                 m.norm.register_forward_hook(lambda _m, _i, out: self._see("final_norm", out.dtype))]

        def residual(_m: Any, args: tuple[Any, ...], out: Tensor) -> None:  # a hook returning None keeps the output
            self._see("residual", args[0].dtype)
            self._see("residual", out.dtype)

        hooks += [layer.register_forward_hook(residual) for layer in m.layers]
        attend, head_operands = model_mod.attend, objective_mod.head_operands

        def probed_attend(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            for name, t in (("q", q), ("k", k), ("v", v)):
                self._see(f"attention_{name}", t.dtype)
            return attend(q, k, v, *args, **kwargs)

        def probed_head_operands(hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
            h, w = head_operands(hidden, weight)
            self._see("loss_head_hidden", h.dtype)
            self._see("loss_head_weight", w.dtype)
            self._see("loss_head_weight_copied", w is not weight)
            return h, w

        model_mod.attend, objective_mod.head_operands = probed_attend, probed_head_operands
        dflash2_mod.head_operands = probed_head_operands
        self._undo = [*(h.remove for h in hooks),
                      lambda: setattr(model_mod, "attend", attend),
                      lambda: setattr(objective_mod, "head_operands", head_operands),
                      lambda: setattr(dflash2_mod, "head_operands", head_operands)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def as_dict(self) -> dict[str, list[str]]:
        return {k: sorted(v) for k, v in sorted(self.seen.items())}

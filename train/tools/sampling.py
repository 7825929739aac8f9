"""Speculative sampling: verification at temperature > 0 that keeps the teacher's output distribution.

A cycle drafts ``k`` tokens ``x_1..x_k``, draft ``i`` drawn from a proposal distribution ``q_i`` (the
drafter's warped distribution for block row ``i``; any proposal works, e.g. a candidate selector's, as long
as ``q_i`` is the distribution the draft was really drawn from). One teacher forward gives ``p_1..p_{k+1}``,
the teacher's warped next-token distributions after the accepted context and each draft prefix. Then, in
order (Leviathan et al. 2023, Chen et al. 2023):

* draft ``i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``;
* at the first rejection the cycle emits one token drawn from the residual ``norm(max(p_i - q_i, 0))`` and
  ends;
* when every draft is accepted, one more token is drawn from ``p_{k+1}``.

Each emitted token is then distributed exactly as ``p_i``: ``P(x) = min(p, q)(x) + (1 - sum min(p, q)) *
residual(x) = p(x)``. Temperature 0 is greedy decoding (kept on its own exact path by the callers).
``warp`` applies temperature, then top-k, then top-p (nucleus) to logits, the teacher's and the drafter's
alike, as serving engines do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_cache.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 = greedy; ``top_k`` 0 = off; ``top_p`` 1 = off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        for name, value in (("--temperature", self.temperature), ("--top-p", self.top_p)):
            if not math.isfinite(value):
                raise ConfigError(f"{name} {value}: must be a finite number")
        if self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k and top-p (at least one token
    always stays)."""
    z = logits.float() / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = z.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
        drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class RejectionSampler:
    """The verification rule of speculative sampling (module docstring), drawing from ``generator``."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)

    def sample(self, probs: Tensor) -> int:
        """One token from probs [V]."""
        return int(torch.multinomial(probs.float().cpu(), 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))

    def accept_probability(self, p_x: float, q_x: float) -> float:
        """P(accept draft x) = min(1, p(x) / q(x))."""
        return 1.0 if q_x <= p_x else p_x / q_x

    def residual(self, p: Tensor, q: Tensor) -> Tensor:
        """The distribution of the token emitted at a rejection: norm(max(p - q, 0)) [V] (p itself when
        p <= q everywhere, which a rejection makes impossible up to rounding)."""
        r = (p - q).clamp(min=0)
        total = r.sum()
        return r / total if total > 0 else p

    def verify(self, drafts: list[int], q: Tensor, p: Tensor) -> list[int]:
        """The tokens a cycle emits: the accepted drafts, then one token from the residual or from p_{k+1}.

        drafts [k] drawn from q [k, V]; p [k+1, V] the teacher's distribution after each draft prefix."""
        q, p = q.float().cpu(), p.float().cpu()
        out: list[int] = []
        for i, x in enumerate(drafts):
            if self.uniform() < self.accept_probability(float(p[i, x]), float(q[i, x])):
                out.append(x)
                continue
            return out + [self.sample(self.residual(p[i], q[i]))]
        return out + [self.sample(p[len(drafts)])]

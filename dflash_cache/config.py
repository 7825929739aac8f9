"""The cache's config section: the layout of the feature cache, part of its spec and fingerprint.

Torch-free, like every stage's config module: :mod:`dflash_cache.runtime.schema` composes it with the
stages' sections into the one ``PipelineConfig``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .runtime.section import Section


class CacheConfig(Section):
    """The feature cache's layout (docs/cache.md); part of its spec and fingerprint."""

    codec: Literal["bf16-zstd", "bf16-lz4", "bf16-raw", "fp8-e4m3"] = "bf16-zstd"
    """`bf16-zstd` (lossless, default), `bf16-lz4` (lossless, faster decode, larger), `bf16-raw`, `fp8-e4m3`
    (lossy, one scale per token per layer)."""
    bucket_edges: list[int] = Field(default_factory=lambda: [256, 512, 1024, 2048])
    """Length bucket upper edges (strictly increasing, below `data.max_length`); the last bucket runs to
    `data.max_length`."""
    target_layer_ids: list[int] | None = None
    """Teacher layers whose outputs are captured (layer k = HF `hidden_states[k+1]`); unset:
    `num_target_layers` spaced uniformly from 1 to L-3."""
    num_target_layers: int = Field(5, gt=0)
    """Number of teacher layers captured when `target_layer_ids` is not given."""
    store_target_argmax: bool = False
    """Also store the teacher's argmax token per position (computes the lm_head)."""
    store_final_hidden: bool = False
    """Also store the teacher's final normed hidden state per position (HF `hidden_states[-1]`, what its lm_head
    reads) as one more slot of the features, same codec: needed by the distribution losses (`train.loss` =
    `kl`, `tv`, `lk_lambda`, `lk_alpha`); runs the whole teacher stack; one hidden size more per token."""
    chunk_tokens: int = Field(256, gt=0)
    """Inner chunk length along tokens (the unit of a random read)."""
    shard_tokens: int = Field(16384, gt=0)
    """Tokens per shard file; a multiple of `chunk_tokens`."""

    @field_validator("bucket_edges")
    @classmethod
    def _check_edges(cls, edges: list[int]) -> list[int]:
        if sorted(set(edges)) != edges or any(e <= 0 for e in edges):
            raise ValueError(f"must be strictly increasing positive token lengths, got {edges}")
        return edges

    @model_validator(mode="after")
    def _check(self) -> CacheConfig:
        if self.shard_tokens % self.chunk_tokens:
            raise ValueError("shard_tokens must be a multiple of chunk_tokens")
        return self



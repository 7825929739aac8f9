"""The one config schema shared by ``dflash-extract`` and ``dflash-train``.

A preset in ``configs/`` is a TOML file with these sections; unknown keys are errors. Each
component receives only its own section (``cfg.cache``, ``cfg.loader`` ...), never the whole.
Section owners: teacher/data/regenerate/extract -> extract, cache -> dflash_cache,
model/train/loader/checkpoint/guards/eval/metrics -> train.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TeacherConfig(Section):
    # A local HF model directory, a hub id, or "builtin:tiny" (built locally on first use).
    path: str = "builtin:tiny"
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    trust_remote_code: bool = False
    device: str = "auto"  # "auto" = cuda:LOCAL_RANK when available, else cpu
    device_map: str | None = None  # e.g. "auto" to split a big teacher over the visible GPUs
    attn_implementation: str | None = None


class DataConfig(Section):
    # JSONL / Parquet / saved HF dataset dir, or "builtin:tiny-chat".
    path: str = "builtin:tiny-chat"
    max_length: int = Field(3072, gt=1)
    min_loss_tokens: int | None = Field(None, ge=1)  # default: 2 * model.block_size
    skip_bad: bool = False  # malformed lines become counted skips instead of errors
    system_prompt: str | None = None
    enable_thinking: bool | None = None  # passed to chat templates that take it


class RegenerateConfig(Section):
    max_new_tokens: int = Field(512, gt=0)
    batch_size: int = Field(8, gt=0)
    temperature: float = Field(0.0, ge=0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0


class CacheConfig(Section):
    codec: Literal["bf16-zstd", "bf16-lz4", "bf16-raw", "fp8-e4m3"] = "bf16-zstd"
    bucket_edges: list[int] = Field(default_factory=lambda: [256, 512, 1024, 2048])
    target_layer_ids: list[int] | None = None  # None: num_target_layers spaced from 1 to L-3
    num_target_layers: int = Field(5, gt=0)
    store_target_argmax: bool = False
    chunk_tokens: int = Field(256, gt=0)  # inner chunk length along tokens
    shard_tokens: int = Field(16384, gt=0)  # tokens per shard file

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


class ExtractConfig(Section):
    tokens_per_batch: int = Field(8192, gt=0)
    max_batch_size: int = Field(64, gt=0)
    unit_size: int = Field(256, gt=0)  # samples per work unit (resume granularity)
    max_inflight_bytes: int = Field(2 << 30, gt=0)  # device->host + write queue bound
    writer_threads: int = Field(2, gt=0)
    on_nonfinite: Literal["skip", "error"] = "skip"
    # batch planning: each extra batch costs this fraction of tokens_per_batch (less padding vs fewer batches)
    batch_overhead: float = Field(0.02, ge=0)


class ModelConfig(Section):
    num_hidden_layers: int = Field(5, gt=0)
    block_size: int = Field(16, ge=2)
    mask_token_id: int | None = Field(None, ge=0)  # None: the teacher vocab's reserved id (Qwen3: 151669)
    num_attention_heads: int = Field(32, gt=0)
    num_key_value_heads: int = Field(8, gt=0)
    head_dim: int = Field(128, gt=0)
    intermediate_size: int = Field(12288, gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    sliding_window: int | None = None
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    init_from: str | None = None  # a released drafter directory (config.json + safetensors)


class TrainConfig(Section):
    seed: int = 0
    epochs: int = Field(6, gt=0)
    max_steps: int | None = Field(None, gt=0)
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    grad_accum: int = Field(1, gt=0)
    num_anchors: int = Field(512, gt=0)
    loss_gamma: float | None = Field(None, gt=0)  # None: 7 for B=16, 5 for B=10, 4 for B=8
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    # Fault injection for tests and drills (real code path, off by default): the loss of each listed
    # step is replaced by NaN, or multiplied by inject_spike_scale, before backward.
    inject_nan_steps: list[int] = Field(default_factory=list)
    inject_spike_steps: list[int] = Field(default_factory=list)
    inject_spike_scale: float = 1e6


class LoaderConfig(Section):
    tokens_per_batch: int = Field(16384, gt=0)  # rows * padded length <= this; a longer sample is an error
    num_readers: int = Field(2, gt=0)
    max_buffer_bytes: int = Field(1 << 30, gt=0)  # prefetched batches held in host memory, at most
    packing: bool = False  # pack several samples per row (doc_ids/position_ids mark documents)
    pack_row_tokens: int | None = Field(None, gt=0)  # packed row length; None: tokens_per_batch
    sort_window: int = Field(64, gt=0)  # batches' worth of tokens sorted by length together
    on_corrupt: Literal["error", "skip"] = "error"
    live: bool = False  # follow a cache still being extracted
    live_poll_s: float = Field(5.0, gt=0)
    live_timeout_s: float | None = Field(None, gt=0)  # stop waiting for new parts after this long idle
    holdout_fraction: float = Field(0.02, ge=0, lt=1)  # samples (by id hash) kept for evaluation
    pin_memory: bool = True  # page-locked host batches when a CUDA device is used


class CheckpointConfig(Section):
    every_steps: int = Field(1000, gt=0)
    keep_last: int = Field(3, ge=2)  # >= 2: the newest may still be being written
    save_on_signal: bool = True
    resume: bool = True  # continue from the latest valid checkpoint in the run dir
    # resume even if the cache fingerprint differs from the one the checkpoint was trained on
    ignore_fingerprint_mismatch: bool = False


class GuardsConfig(Section):
    window: int = Field(128, ge=8)
    min_history: int = Field(16, ge=4)
    z_threshold: float = Field(6.0, gt=0)
    # a spike must also be at least min_ratio x the window median: small tail batches have a
    # naturally larger grad norm (measured up to ~9x the median on the tiny demo), explosions are orders of magnitude
    min_ratio: float = Field(10.0, ge=1)
    max_consecutive_skips: int = Field(20, gt=0)


class EvalConfig(Section):
    every_steps: int | None = Field(None, gt=0)  # held-out teacher-forced acceptance during training (eval/*)
    max_blocks: int | None = Field(None, gt=0)
    live_prompts: int = Field(4, ge=0)
    live_max_new_tokens: int = Field(64, gt=0)


class MetricsConfig(Section):
    tensorboard: bool = True
    smoothing_window: int = Field(50, gt=0)
    progress_bar: bool = True


class PipelineConfig(Section):
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _cross_check(self) -> PipelineConfig:
        """Checks across sections, each reported at the field to change."""
        max_len = self.data.max_length
        errors = []
        over = [e for e in self.cache.bucket_edges if e >= max_len]
        if over:
            errors.append(_field_error(
                ("cache", "bucket_edges"), self.cache.bucket_edges,
                f"edges {over} are not below data.max_length ({max_len}): samples are truncated to max_length, so "
                "those buckets would stay empty; use edges below data.max_length (or raise it)"))
        if self.extract.tokens_per_batch < max_len:
            errors.append(_field_error(
                ("extract", "tokens_per_batch"), self.extract.tokens_per_batch,
                f"is below data.max_length ({max_len}): a sample of max_length tokens would not fit in a batch; "
                "set it to at least data.max_length"))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self


def _field_error(loc: tuple[str, ...], value: object, message: str) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError("cross_check", message), loc=loc, input=value)

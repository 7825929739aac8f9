"""The one config schema shared by ``dflash-extract`` and ``dflash-train``.

A preset in ``configs/`` is a TOML file with these sections; unknown keys are errors. Each
component receives only its own section (``cfg.cache``, ``cfg.loader`` ...), never the whole.
Section owners: teacher/data/regenerate/extract -> extract, cache -> dflash_cache,
model/train/loader/checkpoint/guards/eval/metrics -> train.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TeacherConfig(Section):
    # A local HF model directory, a hub id, or a tiny teacher built locally on first use: "builtin:tiny"
    # (Qwen3), "builtin:tiny-qwen3_5" (hybrid Gated DeltaNet), "builtin:tiny-qwen3_moe", "builtin:tiny-llama".
    path: str = "builtin:tiny"
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    trust_remote_code: bool = False
    device: str = "auto"  # "auto" = cuda:LOCAL_RANK when available, else cpu
    device_map: str | None = None  # e.g. "auto" to split a big teacher over the visible GPUs
    attn_implementation: str | None = None
    # The teacher's shapes, for `dflash-train estimate` on a machine without its weights or the hub (the
    # cache's spec, or the model's config.json when present, takes precedence); extraction checks them.
    hidden_size: int | None = Field(None, gt=0)
    vocab_size: int | None = Field(None, gt=0)
    num_layers: int | None = Field(None, gt=0)


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
    # A reply ends before the first of these strings (not included), in both the in-process and endpoint paths.
    stop: list[str] = Field(default_factory=list)
    # Base URL of an OpenAI-compatible server (vllm serve, SGLang), e.g. "http://host:8000" (a trailing /v1 is
    # accepted); None: generate in this process with HF generate. The CLI's --endpoint sets it.
    endpoint: str | None = None
    # The served model to request. None: the one of the server's /v1/models whose name is teacher.path (or
    # ends with the same last path component); an error if none is. Set it to vouch that a model served under
    # another name is the teacher (CLI: --served-model).
    served_model: str | None = None
    max_concurrency: int = Field(64, gt=0)  # endpoint requests in flight (one per conversation)
    request_timeout_s: float = Field(600.0, gt=0)  # seconds without a byte from the server before a retry
    max_retries: int = Field(6, ge=0)  # retries of a request after 429/5xx/timeouts/lost connections
    retry_backoff_s: float = Field(1.0, gt=0)  # first wait before a retry; doubles each time (capped at 60 s)
    # stop the run when this many conversations in a row failed (server down or misconfigured)
    max_consecutive_failures: int = Field(50, gt=0)
    # fsync the output at most this often (and at the end); a killed process never loses written answers,
    # a machine crash loses at most this many seconds of them
    fsync_every_s: float = Field(5.0, ge=0)
    api_key_env: str | None = None  # environment variable holding the server's API key (sent as Bearer)
    # extra fields merged into every request body (engine-specific sampling, e.g. {top_k = 20, min_p = 0})
    extra_body: dict[str, Any] = Field(default_factory=dict)


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
    # The drafter's block-filler id. Extraction records it in the cache (this value when set, else the
    # teacher tokenizer's mask token); training reads the cache's, and a different value here is an error.
    mask_token_id: int | None = Field(None, ge=0)
    num_attention_heads: int = Field(32, gt=0)
    num_key_value_heads: int = Field(8, gt=0)
    head_dim: int = Field(128, gt=0)
    intermediate_size: int = Field(12288, gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    sliding_window: int | None = None
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    # How sliding_attention layers attend within the draft block: "bidirectional" (the DFlash reference and
    # vLLM/SGLang) or "causal"; full_attention layers are always bidirectional. Written into the export.
    sliding_within_block: Literal["bidirectional", "causal"] = "bidirectional"
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    # keep only each drafter layer's input for backward and recompute the layer (less memory, ~1/3 more compute)
    activation_checkpointing: bool = False
    init_from: str | None = None  # a released drafter directory (config.json + safetensors)


class TrainConfig(Section):
    seed: int = 0
    epochs: int = Field(6, gt=0)
    max_steps: int | None = Field(None, gt=0)
    # "adamw": AdamW over every trainable parameter (the reference recipe). "muon": torch.optim.Muon for the
    # 2-D weight matrices (attention q/k/v/o, MLP, fc) and AdamW (lr, betas, weight_decay) for the rest (norms)
    optimizer: Literal["adamw", "muon"] = "adamw"
    lr: float = Field(6e-4, gt=0)  # peak AdamW lr (every parameter with adamw; the non-matrix ones with muon)
    weight_decay: float = Field(0.0, ge=0)  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's betas
    # peak Muon lr (same warmup + cosine schedule as lr); with muon_adjust_lr = "match_rms_adamw" an update has
    # about the RMS of an AdamW update at this lr, but Muon's best lr is higher (docs/recipe.md)
    muon_lr: float = Field(3e-3, gt=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)  # Muon's (Nesterov) momentum
    muon_weight_decay: float = Field(0.0, ge=0)  # Muon's decoupled weight decay
    muon_ns_steps: int = Field(5, gt=0, lt=100)  # Newton-Schulz iterations orthogonalising each update
    # per-matrix lr scale: "match_rms_adamw" 0.2*sqrt(max(rows, cols)) (Moonlight), "original" sqrt(max(1, rows/cols))
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    grad_accum: int = Field(1, gt=0)
    num_anchors: int = Field(512, gt=0)  # blocks per document (sample), as in the DFlash recipe
    # block rows whose full-vocabulary logits exist at once in the loss (forward and backward); bounds its memory
    logits_chunk_rows: int = Field(2048, gt=0)
    # weights of the block rows in the loss: "exp_decay" exp(-(k-1)/loss_gamma), weighted mean (the reference
    # recipe); "dpace" D-PACE weights from the drafter's own detached confidence per row (docs/recipe.md)
    loss_weighting: Literal["exp_decay", "dpace"] = "exp_decay"
    loss_gamma: float | None = Field(None, gt=0)  # exp_decay only; None: 7 for B=16, 5 for B=10, 4 for B=8
    dpace_alpha: float = Field(0.5, gt=0, le=1)  # dpace only: confidence smoothing (1-alpha)*q + alpha
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    # refuse to start on a GPU when `dflash-train estimate` predicts a step peak above its memory
    check_memory: bool = True

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.loss_weighting == "dpace" and self.loss_gamma is not None:
            raise ValueError("loss_gamma sets the exp_decay weights; with loss_weighting = \"dpace\" leave it "
                             "unset (dpace_alpha is D-PACE's parameter)")
        return self


class LoaderConfig(Section):
    tokens_per_batch: int = Field(16384, gt=0)  # rows * padded length <= this; a longer sample is an error
    # block positions (blocks x block_size) per batch, at most; a batch of many short documents holds fewer
    # documents so that the drafter's activations per step stay bounded (each document: min(train.num_anchors,
    # length - 1) blocks, an upper bound of its eligible anchors)
    max_block_positions: int = Field(65536, gt=0)
    num_readers: int = Field(2, gt=0)
    max_buffer_bytes: int = Field(1 << 30, gt=0)  # prefetched batches held in host memory, at most
    packing: bool = False  # pack several samples per row (doc_ids/position_ids mark documents)
    pack_row_tokens: int | None = Field(None, gt=0)  # packed row length; None: tokens_per_batch
    sort_window: int = Field(64, gt=0)  # batches' worth of tokens sorted by length together
    on_corrupt: Literal["error", "skip"] = "error"
    # follow a cache still being extracted (needs train.max_steps: the run's length cannot be planned from it)
    live: bool = False
    live_poll_s: float = Field(5.0, gt=0)  # how often live mode looks for the cache and newly committed parts
    # live mode: give up waiting for the cache to appear, or end an epoch, after this long without a new part
    live_timeout_s: float | None = Field(None, gt=0)
    holdout_fraction: float = Field(0.02, ge=0, lt=1)  # samples (by id hash) kept for evaluation
    pin_memory: bool = True  # page-locked host batches when a CUDA device is used


class CheckpointConfig(Section):
    every_steps: int = Field(1000, gt=0)
    keep_last: int = Field(3, ge=2)  # >= 2: the newest may still be being written
    save_on_signal: bool = True
    resume: bool = True  # continue from the latest valid checkpoint in the run dir
    # resume even if the cache fingerprint differs from the one the checkpoint was trained on
    ignore_fingerprint_mismatch: bool = False
    # resume although the config differs from the checkpoint's in a field that changes the result (lr, schedule,
    # optimizer, model ...): the new values apply from the resumed step on, and the change is logged
    allow_config_change: bool = False
    # when the run dir holds checkpoints but none is valid, move them and the metrics to RUN/discarded-<time>/
    # and start from step 0 (otherwise the run stops and says what it found)
    discard_invalid: bool = False


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
    live_prompts: int = Field(4, ge=0)  # live decoding prompts, from the evaluated (held-out) samples of the cache
    live_max_new_tokens: int = Field(64, gt=0)


class MetricsConfig(Section):
    tensorboard: bool = True  # write TensorBoard event files (metrics.jsonl is always written)
    smoothing_window: int = Field(50, gt=0)  # steps covered by the *_smooth scalars
    progress_bar: bool = True
    # also log every scalar to Weights & Biases (pip install 'dflash-pipeline[wandb]'; WANDB_MODE=offline works
    # without a network); the run id is kept in RUN/wandb_run_id so a resume continues the same W&B run
    wandb: bool = False
    wandb_project: str = "dflash"  # W&B project
    wandb_entity: str | None = None  # W&B team or user; None: the account's default entity
    wandb_run_name: str | None = None  # W&B display name; None: the run dir's name


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
        if self.loader.live and self.train.max_steps is None:
            errors.append(_field_error(
                ("train", "max_steps"), None,
                "is required when loader.live = true: the cache is still being extracted, so the number of steps "
                "(and the lr schedule) cannot be planned from it; set --set train.max_steps=N"))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self


def _field_error(loc: tuple[str, ...], value: object, message: str) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError("cross_check", message), loc=loc, input=value)

"""Training's config sections: ``[model]``, ``[train]``, ``[loader]``, ``[checkpoint]``, ``[guards]``,
``[eval]`` and ``[metrics]``.

Torch-free (pydantic only): :mod:`dflash_cache.runtime.schema` composes these with the other stages'
sections into the one ``PipelineConfig`` without importing torch or any training code. The checks between
these sections are :func:`check_sections`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import InitErrorDetails

from dflash_cache.runtime.section import Section, field_error


class ModelConfig(Section):
    """The DFlash drafter (written into the export's config.json)."""

    num_hidden_layers: int = Field(5, gt=0)
    """Drafter decoder layers."""
    block_size: int = Field(16, ge=2)
    """B: tokens per block (the anchor + B-1 predictions)."""
    mask_token_id: int | None = Field(None, ge=0)
    """The drafter's block-filler id. Extraction records it in the cache (this value when set, else the
    teacher tokenizer's mask token); training reads the cache's, and a different value here is an error."""
    num_attention_heads: int = Field(32, gt=0)
    """Drafter query heads."""
    num_key_value_heads: int = Field(8, gt=0)
    """Drafter key/value heads."""
    head_dim: int = Field(128, gt=0)
    """Per-head dimension."""
    intermediate_size: int = Field(12288, gt=0)
    """SwiGLU MLP width."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1_000_000.0
    """RoPE base (absolute positions of context and block)."""
    max_position_embeddings: int = 40960
    """Written into the exported config."""
    sliding_window: int | None = None
    """Window of the `sliding_attention` layers."""
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    """Per layer `full_attention` / `sliding_attention`; unset: all full attention."""
    sliding_within_block: Literal["bidirectional", "causal"] = "bidirectional"
    """How `sliding_attention` layers attend within the draft block: `bidirectional` (the DFlash reference and
    vLLM/SGLang) or `causal`; `full_attention` layers are always bidirectional. Written into the export."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """`flex` (FlexAttention, GPU), `sdpa` (explicit boolean mask), `auto` = flex on CUDA, else sdpa."""
    activation_checkpointing: bool = False
    """Keep only each drafter layer's input for backward and recompute the layer (less memory, ~1/3 more
    compute)."""
    init_from: str | None = None
    """A released drafter directory (config.json + safetensors) to start from; its config.json is read as the DFlash reference reads it (is_causal, input_embedding_scale: docs/fidelity.md) and fields this trainer does not implement are refused by name. Its shapes must equal this section's (the error says which `--set model.KEY=VALUE`)."""
    arch: Literal["dflash", "dflash2"] = "dflash"
    """Drafter family: `dflash`, or `dflash2` (DFlash plus a grouped dynamic causal convolution before and after
    each attention and MLP sublayer, and a low-rank candidate selector over the unary top-K; docs/architecture.md).
    Exported as `DFlashDraftModel` / `DFlash2DraftModel`."""
    conv_kernel_size: int = Field(2, gt=0)
    """`dflash2`: taps of the dynamic causal convolution (it never reaches across a block boundary)."""
    conv_group_size: int = Field(16, gt=0)
    """`dflash2`: channels sharing one dynamic kernel (must divide the teacher's hidden size)."""
    selector_top_k: int = Field(256, gt=0)
    """`dflash2`: unary candidates per position that the selector rescores (capped at the vocabulary size)."""
    selector_rank: int = Field(16, gt=0)
    """`dflash2`: rank of the selector's bilinear previous-token x candidate term."""
    output_multiplier: float = Field(1.0, gt=0)
    """Unary logits are multiplied by this (both families)."""
    final_logit_softcapping: float | None = Field(None, gt=0)
    """Unary logits become `cap * tanh(logits / cap)` after `output_multiplier` (both families); unset: none."""



class TrainConfig(Section):
    """The optimizer, schedule and loss of `dflash-train`."""

    seed: int = 0
    """Initialisation, plan order and anchor sampling."""
    collective_timeout_s: float = Field(900.0, gt=0)
    """Multi-process runs: how long a collective waits for the slowest rank before the run stops with an
    error naming the ranks that stopped reporting (a dead or hung node). Must exceed the longest held-out
    evaluation and checkpoint save."""
    epochs: int = Field(6, gt=0)
    """Passes over the (non-held-out) cache."""
    max_steps: int | None = Field(None, gt=0)
    """Stop after this many optimizer steps; unset: epochs x batches per epoch (required with
    `loader.live`)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """`adamw`: AdamW over every trainable parameter (the reference recipe). `muon`: torch.optim.Muon for the
    2-D weight matrices (attention q/k/v/o, MLP, fc) and AdamW (`lr`, `betas`, `weight_decay`) for the rest
    (norms); see docs/recipe.md."""
    lr: float = Field(6e-4, gt=0)
    """Peak AdamW learning rate (every parameter with `adamw`; the non-matrix ones with `muon`)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    muon_lr: float = Field(3e-3, gt=0)
    """Peak Muon learning rate (same warmup + cosine schedule as `lr`); with `muon_adjust_lr =
    "match_rms_adamw"` an update has about the RMS of an AdamW update at this lr, but Muon's best lr is higher
    (docs/recipe.md)."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """Muon's (Nesterov) momentum."""
    muon_weight_decay: float = Field(0.0, ge=0)
    """Muon's decoupled weight decay."""
    muon_ns_steps: int = Field(5, gt=0, lt=100)
    """Newton-Schulz iterations orthogonalising each Muon update."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Per-matrix Muon lr scale: `match_rms_adamw` 0.2*sqrt(max(rows, cols)), `original` sqrt(max(1, rows/cols))."""
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    """Linear warmup as a fraction of the total steps, then cosine decay."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Cosine floor as a fraction of `lr`."""
    grad_clip: float = Field(1.0, gt=0)
    """Max gradient norm (the logged `train/grad_norm` is before clipping)."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches per optimizer step."""
    num_anchors: int = Field(512, gt=0)
    """Blocks sampled per document (sample) per step, without replacement, re-drawn every epoch (the DFlash
    recipe's 512)."""
    logits_chunk_rows: int = Field(2048, gt=0)
    """Block rows whose full-vocabulary logits exist at once in the loss (forward and backward); bounds its
    memory."""
    loss: Literal["ce", "kl", "tv", "lk_lambda", "lk_alpha"] = "ce"
    """Per block row: `ce` on the data token; or against the teacher's distribution (needs a cache extracted
    with `cache.store_final_hidden`): `kl` forward KL, `tv` total variation, `lk_alpha` -log(acceptance
    probability), `lk_lambda` an acceptance-adaptive KL/TV blend (LK losses; formulas in train/models/distill.py)."""
    loss_ce_weight: float = Field(0.0, ge=0, lt=1)
    """With a distribution `loss`: each row's loss is `w` x CE + (1 - `w`) x the distribution loss (e.g. 0.5)."""
    lk_eta: float = Field(3.0, gt=0)
    """`lk_lambda` only: the KL share exp(-eta x acceptance probability) of each row."""
    loss_weighting: Literal["exp_decay", "dpace"] = "exp_decay"
    """Weights of the block rows in the loss: `exp_decay` exp(-(k-1)/`loss_gamma`), weighted mean (the reference
    recipe); `dpace` D-PACE weights from the drafter's own detached confidence per row (docs/recipe.md)."""
    loss_gamma: float | None = Field(None, gt=0)
    """`exp_decay` only: decay of the per-position loss weight exp(-(k-1)/gamma); unset: 7 for B=16, 5 for
    B=10, 4 for B=8."""
    dpace_alpha: float = Field(0.5, gt=0, le=1)
    """`dpace` only: confidence smoothing (1-alpha)*q + alpha."""
    selector_alpha: float = Field(1.0, ge=0)
    """`model.arch = "dflash2"`: weight of the candidate selector's loss, added to the unary loss. Each counted row's
    selector CE (over the unary top-K, rescored with the true previous token) takes that row's unary weight."""
    selector_gold_outside: Literal["drop", "append"] = "drop"
    """`dflash2`: a row whose true token is not among the unary top-K: `drop` gives it no selector loss (the selector
    can never pick it; the unary loss is what pulls it into the top-K), `append` scores the true token as an extra
    candidate so the row still trains the selector."""
    selector_detach_backbone: bool = False
    """`dflash2`: stop the selector loss's gradient at the drafter's hidden states and unary logits (only the
    selector's own weights learn from it)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """`auto`: bf16 autocast on GPU, fp32 on CPU."""
    check_memory: bool = True
    """Refuse to start on a GPU when `dflash-train estimate` predicts a step peak above its memory."""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.loss == "ce" and self.loss_ce_weight:
            raise ValueError("loss_ce_weight mixes CE into a distribution loss; with loss = \"ce\" leave it at 0 "
                             "(or set loss to kl, tv, lk_lambda or lk_alpha)")
        if self.loss_weighting == "dpace" and self.loss_gamma is not None:
            raise ValueError("loss_gamma sets the exp_decay weights; with loss_weighting = \"dpace\" leave it "
                             "unset (dpace_alpha is D-PACE's parameter)")
        return self



class LoaderConfig(Section):
    """The streaming loader of `dflash-train`: batching plan, reader threads, prefetch buffer."""

    tokens_per_batch: int = Field(16384, gt=0)
    """Rows x padded length per batch, at most; a longer sample is an error."""
    max_block_positions: int = Field(65536, gt=0)
    """Block positions (blocks x block size) per batch, at most: a batch of many short documents holds fewer
    documents so that the drafter's activations per step stay bounded (each document counts
    min(`train.num_anchors`, length - 1) blocks, an upper bound of its eligible anchors)."""
    num_readers: int = Field(2, gt=0)
    """Reader threads decoding cache parts (on CPU, torch's compute threads are the cores left over)."""
    max_buffer_bytes: int = Field(1 << 30, gt=0)
    """Prefetched batches held in host memory, at most."""
    packing: bool = False
    """Pack several samples per row (doc ids / position ids mark documents)."""
    pack_row_tokens: int | None = Field(None, gt=0)
    """Packed row length; unset: `tokens_per_batch`."""
    sort_window: int = Field(64, gt=0)
    """Batches' worth of tokens sorted by length together."""
    locality_parts: int | None = Field(None, gt=0)
    """Read locality for object stores: each bucket's samples are shuffled within groups of this many parts
    (the groups in a random order each epoch) instead of over the whole bucket, so the loader's read-ahead
    finds many planned samples per shard and coalesces them into few large requests (docs/performance.md);
    unset: a full shuffle per bucket."""
    locality_run_samples: int | None = Field(None, gt=0)
    """With `locality_parts`: group runs of this many consecutive samples of a part instead of whole parts
    (a group is then `locality_parts` runs), so that a read-ahead smaller than a part still finds each run's
    samples together and fetches a run in one request; unset: whole parts."""
    on_corrupt: Literal["error", "skip"] = "error"
    """A part failing its checksums: `error` (names it) or `skip` (quarantined, counted, logged)."""
    live: bool = False
    """Follow a cache still being extracted (needs `train.max_steps`: the run's length cannot be planned from
    it); see docs/operations.md."""
    allow_unfinished: bool = False
    """Train on a cache whose extraction has not finished (`dflash-cache info` says "extraction not finished:
    N of M units"): only the committed units are trained on. Unset, such a cache is refused (outside live
    mode) with the command that finishes it."""
    live_poll_s: float = Field(5.0, gt=0)
    """How often live mode looks for the cache and newly committed parts."""
    live_timeout_s: float | None = Field(None, gt=0)
    """Live mode: give up waiting for the cache to appear, or end an epoch, after this long without a new
    part; unset: wait for the extraction report."""
    holdout_fraction: float = Field(0.02, ge=0, lt=1)
    """Samples (by id hash) kept out of training for evaluation."""
    pin_memory: bool = True
    """Page-locked host batches when a CUDA device is used."""
    read_ahead: Literal["auto", "on", "off"] = "auto"
    """Fetch the planned batches' feature bytes ahead of the decode threads, in few large coalesced range
    requests with many in flight (docs/performance.md); `auto`: on for object stores and other fsspec URLs,
    off for local paths (read in place)."""
    read_ahead_bytes: int = Field(1 << 30, gt=0)
    """Compressed bytes fetched (or in flight) ahead of the decode threads, at most (host memory; where the
    store reads into a caller's buffer, buffers are kept for reuse: docs/cache.md). A request
    streams at one connection's rate (~100 MB/s on S3), so keep it at least `requests_in_flight` x
    `max_request_bytes` (docs/performance.md: these defaults against 256 MiB, 16 and 64 MiB)."""
    requests_in_flight: int = Field(32, gt=0)
    """Range requests running at once (separate threads from the decode threads; keep the S3 connection
    pool, 64 by default, above it)."""
    coalesce_gap_bytes: int = Field(1 << 20, ge=0)
    """Ranges of one shard object at most this far apart are fetched in one request (the gap is read too)."""
    max_request_bytes: int = Field(32 << 20, gt=0)
    """Largest coalesced request (a single sample's range is never split). The first batch after a start or
    resume is split over every stream instead (its bytes / `requests_in_flight`, at least 1 MiB)."""



class CheckpointConfig(Section):
    """Checkpoints in `RUN/checkpoints/` and the resume rules (docs/operations.md)."""

    every_steps: int = Field(1000, gt=0)
    """Save every N optimizer steps (also at the end and on SIGTERM/SIGINT)."""
    keep_last: int = Field(3, ge=2)
    """Checkpoints kept; at least 2: the newest may still be being written."""
    save_on_signal: bool = True
    """Save a checkpoint when SIGTERM/SIGINT arrives, then exit 128+N."""
    resume: bool = True
    """Continue from the latest valid checkpoint in the run dir."""
    ignore_fingerprint_mismatch: bool = False
    """Resume even if the cache fingerprint differs from the one the checkpoint was trained on."""
    allow_config_change: bool = False
    """Resume although the config differs from the checkpoint's in a field that changes the result (lr,
    schedule, optimizer, model ...): the new values apply from the resumed step on, and the change is
    logged. The model's family and size (``model.arch``, layer count, heads, widths) never change within a run
    dir: the saved weights would not fit."""
    discard_invalid: bool = False
    """When the run dir holds checkpoints but none is valid, move them and the metrics to
    `RUN/discarded-<time>/` and start from step 0 (otherwise the run stops and says what it found)."""



class GuardsConfig(Section):
    """The spike guard: steps with a non-finite or exploding loss / gradient are skipped."""

    window: int = Field(128, ge=8)
    """Trailing window of good steps for the robust (median/MAD) statistics."""
    min_history: int = Field(16, ge=4)
    """Steps in the window before the spike test is armed."""
    z_threshold: float = Field(6.0, gt=0)
    """Robust z-score above which a pre-clip grad norm or a loss is a spike."""
    min_ratio: float = Field(10.0, ge=1)
    """A spike must also be at least `min_ratio` x the window median: small tail batches have a naturally
    larger grad norm (measured up to ~9x the median on the tiny demo), explosions are orders of magnitude."""
    max_consecutive_skips: int = Field(20, gt=0)
    """Skips in a row that stop the run (exit code 3)."""
    rebaseline_after: int = Field(8, ge=0)
    """Grad-norm spikes among the last 4x this many steps after which the next spike is judged as a level
    shift of the norm (healthy early training moves it 10-20x): accepted, and the window restarted at the
    new level, when neither the norm nor the loss is rising (docs/operations.md#guards); 0: never. Keep it
    below `max_consecutive_skips`, or a level shift stops the run before it can be accepted."""
    rebaseline_max_rise: float = Field(2.0, ge=1)
    """A level shift is refused while the later half of its spikes has a median norm above this many times
    the earlier half's (the norm is still climbing)."""
    rebaseline_max_loss_z: float = Field(2.0)
    """A level shift is refused when the median loss of the later half of its spikes is more than this many
    robust sigmas (batch-to-batch noise) above the median loss of the `rebaseline_after` accepted steps before
    the first spike (the loss is rising)."""



class EvalConfig(Section):
    """Held-out acceptance during training, `dflash-train eval` and the demo's live decoding."""

    every_steps: int | None = Field(None, gt=0)
    """Held-out teacher-forced acceptance every N steps during training (`eval/*` tags); unset: off."""
    max_blocks: int | None = Field(None, gt=0)
    """Cap on held-out blocks per evaluation; unset: every eligible anchor."""
    live_prompts: int = Field(4, ge=0)
    """Live speculative decoding prompts (`eval --live`, the demo), from the evaluated (held-out) samples of
    the cache."""
    live_max_new_tokens: int = Field(64, gt=0)
    """Tokens generated per live prompt."""



class MetricsConfig(Section):
    """What `dflash-train` logs besides `RUN/metrics.jsonl` (the tags: docs/metrics.md)."""

    tensorboard: bool = True
    """Write TensorBoard event files (`metrics.jsonl` is always written)."""
    smoothing_window: int = Field(50, gt=0)
    """Steps covered by the `*_smooth` scalars (divided by the steps actually covered)."""
    progress_bar: bool = True
    """Show the progress bar (rank 0)."""
    wandb: bool = False
    """Also log every scalar to Weights & Biases (the `wandb` extra: `.venv/bin/pip install -e '.[wandb]'` in
    the checkout, the package is not on PyPI; or `pip install wandb`). `WANDB_MODE=offline` works without a
    network; the run id is kept in `RUN/wandb_run_id` so a resume continues the same W&B run."""
    wandb_project: str = "dflash"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B team or user; unset: the account's default entity."""
    wandb_run_name: str | None = None
    """W&B display name; unset: the run dir's name."""


def check_sections(model: ModelConfig, train: TrainConfig, loader: LoaderConfig) -> list[InitErrorDetails]:
    """Checks across training's sections, each reported at the field to change."""
    errors = []
    if loader.live and train.max_steps is None:
        errors.append(field_error(
            ("train", "max_steps"), None,
            "is required when loader.live = true: the cache is still being extracted, so the number of steps "
            "(and the lr schedule) cannot be planned from it; set --set train.max_steps=N"))
    if train.loss != "ce" and (model.arch == "dflash2" or model.output_multiplier != 1.0
                               or model.final_logit_softcapping is not None):
        errors.append(field_error(
            ("train", "loss"), train.loss,
            "is not available with model.arch = dflash2 or a unary logit transform (model.output_multiplier, "
            "model.final_logit_softcapping) yet: those drafters train through the selector loss, whose unary "
            "part is CE; use train.loss = ce, or a DFlash drafter without the transform"))
    return errors

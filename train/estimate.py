"""``dflash-train estimate``: what one training step costs, before a GPU hour is spent.

The drafter's memory per step is counted from the shapes, term by term, the way this trainer allocates
it (train/model.py, train/objective.py); nothing is loaded but the config (and the cache's small arrays
when ``--cache`` is given). A step's peak is

    static   fp32 master weights + AdamW moments (+ bf16 weight copies under autocast) + the frozen
             embedding / lm_head + the batch on the device
    dynamic  activations saved for backward (per block position per layer, per context token per layer;
             only each layer's input with activation checkpointing, plus one layer recomputed)
             + the larger of: the loss head (one chunk of full-vocabulary logits, the counted rows' hidden
             states and their gradient) and one layer's backward working set
             + the parameters' gradients

Block positions per step (blocks x block_size) drive the activations; the plan bounds them
(``loader.max_block_positions``) and ``--cache`` reports their real distribution. The same arithmetic is
checked against measured peaks of real training steps on CPU (tests/test_estimate.py) and, on a GPU,
by ``bench/gpu_check.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

Optimizer = Literal["adamw", "muon"]
GIB = 1024**3


@dataclass(frozen=True)
class DrafterShape:
    """The shapes that size a drafter and its target head."""

    hidden: int  # target hidden size H
    vocab: int  # target vocabulary V
    n_features: int  # captured target layers n (features are n*H wide)
    layers: int  # drafter decoder layers
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    tied_head: bool = False  # embedding and lm_head are one tensor
    sliding_layers: int = 0  # layers with a sliding window (a second mask kind)

    @classmethod
    def from_config(cls, model_cfg: Any, hidden: int, vocab: int, n_features: int, tied_head: bool = False
                    ) -> DrafterShape:
        sliding = sum(t == "sliding_attention" for t in (model_cfg.layer_types or []))
        return cls(hidden, vocab, n_features, model_cfg.num_hidden_layers, model_cfg.num_attention_heads,
                   model_cfg.num_key_value_heads, model_cfg.head_dim, model_cfg.intermediate_size,
                   model_cfg.block_size, tied_head, sliding)

    def param_counts(self) -> tuple[int, int]:
        """(parameters of 2-D weight matrices, other parameters: norm weights)."""
        H, d = self.hidden, self.head_dim
        attn = H * self.heads * d * 2 + H * self.kv_heads * d * 2  # q, o; k, v
        mlp = 3 * H * self.intermediate
        per_layer_2d, per_layer_1d = attn + mlp, 2 * H + 2 * d  # input/post norms; q_norm, k_norm
        two_d = self.n_features * H * H + self.layers * per_layer_2d  # fc + layers
        other = 2 * H + self.layers * per_layer_1d  # hidden_norm, norm + layers
        return two_d, other

    @property
    def params(self) -> int:
        return sum(self.param_counts())


@dataclass(frozen=True)
class StepShape:
    """One step's data: context tokens C (rows x padded length), blocks A, counted block rows N, and how many
    context keys a block row sees on average (its anchor's position in its document)."""

    context_tokens: int
    blocks: int
    counted_rows: int
    mean_context_per_block: float = 0.0
    rows: int = 1  # rows of the batch (SDPA attends row by row)

    @classmethod
    def worst(cls, context_tokens: int, block_positions: int, block_size: int, mean_doc_tokens: float = 0.0
              ) -> StepShape:
        blocks = block_positions // block_size
        return cls(context_tokens, blocks, blocks * (block_size - 1), mean_doc_tokens / 2)


@dataclass(frozen=True)
class Precision:
    """How the step computes: activation bytes (2 under bf16 autocast on GPU, 4 in fp32 on CPU)."""

    compute_bytes: int = 2
    param_bytes: int = 4  # fp32 master weights
    head_bytes: int = 2  # frozen embedding / lm_head as stored in the cache (bf16)
    autocast: bool = True  # bf16 copies of the weights live through forward and backward

    @classmethod
    def for_device(cls, device_type: str, precision: str = "auto") -> Precision:
        bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda")
        return cls(compute_bytes=2, autocast=True) if bf16 else cls(compute_bytes=4, autocast=False)


@dataclass
class MemoryEstimate:
    """Bytes per component of one training step's peak (see the module docstring)."""

    weights: int
    gradients: int
    optimizer_state: int
    autocast_weight_copies: int
    frozen_head: int
    batch: int
    activations: int  # saved for backward through the whole forward
    per_layer: int  # what one layer saves (all of it without checkpointing)
    recomputed_layer: int  # with activation checkpointing: one layer's activations, rebuilt during backward
    attention_workspace: int
    loss_head: int
    backward_working_set: int  # one layer's gradients of activations and of its weights
    host_loader_buffers: int  # host memory, not on the device

    @property
    def static(self) -> int:
        return self.weights + self.optimizer_state + self.autocast_weight_copies + self.frozen_head + self.batch

    @property
    def phases(self) -> dict[str, int]:
        """Dynamic bytes at the step's three high-water marks: the loss head (end of forward), the start of
        backward, the optimizer update (every gradient, no activation)."""
        return {
            "loss_head": self.activations + self.loss_head,
            "backward": self.activations + self.recomputed_layer + self.attention_workspace
            + self.backward_working_set,
            "optimizer": self.gradients + self.weights,  # the update's temporaries: about one copy of the weights
        }

    @property
    def dynamic_peak(self) -> int:
        return max(self.phases.values())

    @property
    def device_peak(self) -> int:
        return self.static + self.dynamic_peak

    def as_dict(self) -> dict[str, int]:
        out = dict(asdict(self))
        out.update(static=self.static, dynamic_peak=self.dynamic_peak, device_peak=self.device_peak)
        return out


def optimizer_state_bytes(shape: DrafterShape, optimizer: Optimizer) -> int:
    """AdamW: two fp32 moments per parameter. Muon: one fp32 momentum per 2-D weight, AdamW's two for the rest."""
    two_d, other = shape.param_counts()
    if optimizer == "muon":
        return 4 * two_d + 8 * other
    return 8 * (two_d + other)


def memory_estimate(shape: DrafterShape, step: StepShape, *, precision: Precision = Precision(),
                    attention: Literal["flex", "sdpa"] = "flex", checkpointing: bool = False,
                    chunk_rows: int = 2048, optimizer: Optimizer = "adamw", loader_host_bytes: int = 0
                    ) -> MemoryEstimate:
    """The peak of one training step, term by term."""
    H, V, B, c = shape.hidden, shape.vocab, shape.block_size, precision.compute_bytes
    C, Q, N = step.context_tokens, step.blocks * B, step.counted_rows
    F = shape.n_features * H
    qd, kvd, inter, heads = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate, shape.heads
    K = C + Q  # keys per layer: context + block rows
    P = shape.params

    weights = P * precision.param_bytes
    autocast_copies = P * 2 if precision.autocast else 0
    head = V * H * precision.head_bytes * (1 if shape.tied_head else 2)
    batch = C * (F * 2 + 8 + 1 + 4 + 8)  # bf16 features; input_ids, loss_mask, doc_ids, position_ids

    # saved for backward, per block position of one layer (elements): input norm out, q before/after norm
    # and RoPE, k of the block rows before norm, the block rows' k and v in the concatenated keys, the
    # attention output reshaped for o_proj, the residual after attention, post norm out, gate, silu(gate),
    # up, gate*up, the layer output; and each RMSNorm's normalised input (its backward keeps it: input and
    # post-attention norms, q_norm, k_norm)
    per_q = H + 2 * qd + kvd + 2 * kvd + qd + H + H + 4 * inter + H + (2 * H + qd + kvd)
    per_c = kvd + 2 * kvd + kvd  # context: k before and after its norm, its k and v in the concatenated keys
    rope = 2 * (C + Q) * shape.head_dim * c
    # fc out, hidden_norm's normalised input and output (+ the features converted to fp32 when not under autocast)
    fused = 3 * C * H * c + (C * F * 4 if c == 4 else 0)
    embed = Q * H * c
    # fused kernels (FlexAttention on GPU, SDPA's flash kernel on CPU) keep the output and the log-sum-exp
    attn_saved = heads * Q * shape.head_dim * c + heads * Q * 4
    attn_transient = 3 * K * kvd * c  # gradients of k and v (and q) being formed
    # the dense path (SDPA, row by row) keeps one additive float mask [Q_r, T + Q_r] per row and layer kind for
    # the whole step: Q x (T + Q / rows) in all for rows of equal blocks
    T = C // max(1, step.rows)
    mask = (1 + int(shape.sliding_layers > 0)) * Q * (T + Q // max(1, step.rows)) * c if attention == "sdpa" else 0
    layer_full = (per_q * Q + per_c * C) * c + attn_saved
    layers_saved = shape.layers * (Q * H * c if checkpointing else layer_full)  # inputs only when checkpointing
    activations = layers_saved + fused + embed + rope + mask + 2 * Q * H * c  # + the final norm's input and output
    attention_ws = attn_transient

    # the loss head: the counted rows' hidden states and their gradient, one chunk of logits (matmul output
    # in the compute dtype, then fp32), and the lm_head in the compute dtype when it is stored otherwise
    chunk = min(chunk_rows, max(N, 1))
    chunk_logits = chunk * V * (4 + (c if c != 4 else 0))
    head_cast = V * H * c if precision.head_bytes != c else 0
    loss_head = 2 * N * H * c + chunk_logits + head_cast
    gradients = P * precision.param_bytes
    # one layer's backward: gradients of the MLP's [Q, I] intermediates and of the residual stream, and of
    # the layer's weights (the last layer's are formed first)
    two_d, _ = shape.param_counts()
    layer_weights = (two_d - shape.n_features * H * H) // max(1, shape.layers)
    backward_ws = (3 * Q * inter + 3 * Q * H) * c + layer_weights * (precision.param_bytes + (2 if precision.autocast else 0))
    opt = optimizer_state_bytes(shape, optimizer)
    return MemoryEstimate(
        weights=weights, gradients=gradients, optimizer_state=opt, autocast_weight_copies=autocast_copies,
        frozen_head=head, batch=batch, activations=activations, per_layer=layer_full,
        recomputed_layer=layer_full if checkpointing else 0,
        attention_workspace=attention_ws, loss_head=loss_head, backward_working_set=backward_ws,
        host_loader_buffers=loader_host_bytes,
    )


def with_distribution_loss(est: MemoryEstimate, shape: DrafterShape, step: StepShape, *,
                           precision: Precision = Precision(), chunk_rows: int = 2048) -> MemoryEstimate:
    """``est`` under a distribution loss (``train.loss`` kl / tv / lk_*, train/distill.py): the batch carries the
    teacher's final state (one more H-wide bf16 slot per context token); the loss head gathers the counted
    rows' teacher states (bf16, and in the compute dtype) and holds, per chunk, the second vocabulary head:
    the drafter's and the teacher's fp32 logits, the teacher's probabilities and one more fp32 [chunk, V]
    temporary (four in all, plus a logits matmul output in the compute dtype), in place of CE's one."""
    H, V, c = shape.hidden, shape.vocab, precision.compute_bytes
    N = step.counted_rows
    chunk = min(chunk_rows, max(N, 1))
    head_cast = V * H * c if precision.head_bytes != c else 0
    teacher_rows = N * H * (2 + (c if c != 2 else 0))
    loss_head = 2 * N * H * c + teacher_rows + chunk * V * (16 + (c if c != 4 else 0)) + head_cast
    return dataclasses.replace(est, batch=est.batch + step.context_tokens * H * 2, loss_head=loss_head)


def flops_per_step(shape: DrafterShape, step: StepShape) -> float:
    """Model FLOPs of one training step, matmuls only, as MFU conventions count them (the forward that
    activation checkpointing recomputes is not counted): the layers forward + backward (3x forward); ``fc``
    forward + weight gradient (its input, the features, needs none); the loss head's logits and their
    gradient (the chunked loss forms both in its forward)."""
    H, B = shape.hidden, shape.block_size
    C, Q = step.context_tokens, step.blocks * B
    qd, kvd = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    fc = 2 * C * shape.n_features * H * H
    per_layer_q = 2 * Q * (H * qd * 2 + H * kvd * 2 + 3 * H * shape.intermediate)  # q,o; k,v; mlp
    per_layer_c = 2 * C * (H * kvd * 2)  # the context's k and v
    # attention (QK^T and PV): each block row sees the context before its anchor and its own block
    attn = 2 * 2 * Q * qd * (step.mean_context_per_block + B)
    head = 2 * step.counted_rows * H * shape.vocab
    return 3.0 * shape.layers * (per_layer_q + per_layer_c + attn) + 2.0 * fc + 2.0 * head


def fits(peak_bytes: int, device_bytes: int) -> bool:
    return peak_bytes <= device_bytes


def human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def max_block_positions_bound(tokens_per_batch: int, max_length: int, num_anchors: int, block_size: int,
                              budget: int) -> tuple[int, int]:
    """(block positions, document length) of the worst batch the plan can produce: documents of length L
    give floor(tokens / L) documents of min(num_anchors, L - 1) blocks, capped by ``budget``."""
    best = (0, 0)
    for L in range(2, max(2, max_length) + 1):
        docs = tokens_per_batch // L
        if docs == 0:
            break
        pos = min(budget, docs * min(num_anchors, L - 1) * block_size)
        if pos > best[0] or (pos == best[0] and best[1] < L):  # the longest documents reaching the bound
            best = (pos, L)
    return best


def attention_kind(requested: str, device_type: str) -> Literal["flex", "sdpa"]:
    if requested in ("flex", "sdpa"):
        return requested  # type: ignore[return-value]
    return "flex" if device_type == "cuda" else "sdpa"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else 0


def run_hours(tokens: float, tokens_per_s: float) -> float:
    return tokens / tokens_per_s / 3600 if tokens_per_s > 0 else math.inf


# ----------------------------------------------------------------------------------------------
# From a config (and optionally a cache) to a report
# ----------------------------------------------------------------------------------------------


@dataclass
class TeacherShape:
    hidden: int
    vocab: int
    num_layers: int
    n_features: int
    source: str  # "cache", "config.json", "preset"


def teacher_shape(cfg: Any, cache: Any | None) -> TeacherShape:
    """The teacher's shapes: the cache's spec, else the teacher's config.json when it can be read without the
    hub, else ``teacher.hidden_size / vocab_size / num_layers`` from the preset. Never downloads."""
    from dflash_cache.errors import ConfigError

    c = cfg.cache
    n_features = len(c.target_layer_ids) if c.target_layer_ids else c.num_target_layers
    if cache is not None:
        t = cache.spec.teacher
        return TeacherShape(int(t.hidden_size), int(t.vocab_size), int(t.num_layers), len(cache.spec.target_layer_ids),
                            "cache")
    t = cfg.teacher
    try:
        text = _local_teacher_config(t)
        if text is not None:
            return TeacherShape(int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers), n_features,
                                "config.json")
    except (OSError, ValueError, AttributeError):
        pass
    missing = [k for k in ("hidden_size", "vocab_size", "num_layers") if getattr(t, k) is None]
    if missing:
        raise ConfigError(
            f"estimate needs the teacher's shapes: {cfg.teacher.path!r} has no local config.json and the config "
            f"lacks {', '.join('teacher.' + k for k in missing)}; pass --cache CACHE, point teacher.path at a "
            "local model directory, or set them (e.g. --set teacher.hidden_size=4096)")
    return TeacherShape(int(t.hidden_size), int(t.vocab_size), int(t.num_layers), n_features, "preset")


def _local_teacher_config(teacher_cfg: Any) -> Any:
    """The teacher's text config from a local directory or the local HF cache (never the network)."""
    from transformers import AutoConfig

    path = teacher_cfg.path
    if path.startswith("builtin:"):  # built on first use by dflash-extract; its preset carries the shapes
        return None
    cfg = AutoConfig.from_pretrained(path, revision=teacher_cfg.revision, local_files_only=True)
    return cfg.get_text_config()


@dataclass
class PlanFigures:
    """Block positions and context tokens per step, from a real plan or the worst case of the budgets."""

    source: str  # "plan" or "worst case"
    mean_doc_tokens: float
    block_positions_median: int
    block_positions_max: int
    context_tokens_median: int
    context_tokens_max: int
    steps_per_epoch: int | None
    tokens_per_epoch: int | None


def worst_case_figures(cfg: Any, max_length: int) -> PlanFigures:
    lc, B = cfg.loader, cfg.model.block_size
    bound, doc_len = max_block_positions_bound(lc.tokens_per_batch, max_length, cfg.train.num_anchors, B,
                                               lc.max_block_positions)
    return PlanFigures("worst case", doc_len, bound, bound, lc.tokens_per_batch, lc.tokens_per_batch, None, None)


def plan_figures(cfg: Any, cache: Any) -> PlanFigures:
    """Epoch 0's plan over the cache, as the trainer's loader would make it (index arrays only; no feature
    is read)."""
    import numpy as np

    from .plan import plan_from_index

    idx = cache.index()
    plan = plan_from_index(idx, cfg.loader, seed=cfg.train.seed, num_anchors=cfg.train.num_anchors,
                           block_size=cfg.model.block_size)
    rows = np.diff(plan.batch_rows)
    ctx = rows * plan.seq_len  # context tokens per step: rows x padded length
    bp = plan.block_positions
    return PlanFigures("plan", float(idx.lengths.mean()) if len(idx) else 0.0, int(np.median(bp)), int(bp.max()),
                       int(np.median(ctx)), int(ctx.max()), len(plan), int(plan.stats.n_tokens))


@dataclass
class EstimateReport:
    shape: DrafterShape
    teacher_source: str
    figures: PlanFigures
    device: str
    attention: str
    peak: MemoryEstimate  # at the largest step
    median: MemoryEstimate  # at the median step
    gpu_memory_bytes: int
    gpu_memory_source: str
    flops_per_step: float
    tokens_per_s: float | None
    tokens_per_s_source: str
    epochs: int
    notes: list[str]

    @property
    def fits(self) -> bool:
        return fits(self.peak.device_peak, self.gpu_memory_bytes)

    def to_json(self) -> dict[str, Any]:
        f = self.figures
        epoch_h = (f.tokens_per_epoch / self.tokens_per_s / 3600) if (f.tokens_per_epoch and self.tokens_per_s) else None
        return {
            "peak_bytes": self.peak.device_peak, "median_step_bytes": self.median.device_peak,
            "fits": self.fits, "gpu_memory_bytes": self.gpu_memory_bytes, "gpu_memory_source": self.gpu_memory_source,
            "block_positions_per_step": {"median": f.block_positions_median, "max": f.block_positions_max,
                                         "source": f.source},
            "context_tokens_per_step": {"median": f.context_tokens_median, "max": f.context_tokens_max},
            "breakdown_at_peak": self.peak.as_dict(), "phases_at_peak": self.peak.phases,
            "drafter_params": self.shape.params, "teacher_shapes_from": self.teacher_source,
            "device": self.device, "attention": self.attention, "flops_per_step": self.flops_per_step,
            "steps_per_epoch": f.steps_per_epoch, "tokens_per_epoch": f.tokens_per_epoch,
            "tokens_per_s": self.tokens_per_s, "tokens_per_s_source": self.tokens_per_s_source,
            "hours_per_epoch": epoch_h, "hours_per_run": epoch_h * self.epochs if epoch_h is not None else None,
            "notes": self.notes,
        }


def estimate_run(cfg: Any, cache: Any | None = None, *, device: str = "cuda", gpu_memory_gib: float | None = None,
                 tokens_per_s: float | None = None, gpu_tflops: float = 989.0, mfu: float = 0.35) -> EstimateReport:
    """The memory, FLOPs and time of a run of ``cfg`` (optionally on ``cache``), without loading weights."""
    notes: list[str] = []
    t = teacher_shape(cfg, cache)
    shape = DrafterShape.from_config(cfg.model, t.hidden, t.vocab, t.n_features)
    max_length = int(cache.spec.max_length) if cache is not None else cfg.data.max_length
    figures = plan_figures(cfg, cache) if cache is not None else worst_case_figures(cfg, max_length)
    precision = Precision.for_device(device, cfg.train.precision)
    attention = attention_kind(cfg.model.attention, device)
    B = shape.block_size
    host = cfg.loader.max_buffer_bytes

    def at(block_positions: int, context_tokens: int) -> MemoryEstimate:
        step = StepShape.worst(context_tokens, block_positions, B, figures.mean_doc_tokens)
        est = memory_estimate(shape, step, precision=precision, attention=attention,
                              checkpointing=cfg.model.activation_checkpointing, chunk_rows=cfg.train.logits_chunk_rows,
                              optimizer=getattr(cfg.train, "optimizer", "adamw"), loader_host_bytes=host)
        return _loss_terms(cfg, est, shape, step, precision)

    peak = at(figures.block_positions_max, figures.context_tokens_max)
    median = at(figures.block_positions_median, figures.context_tokens_median)
    if gpu_memory_gib is not None:
        gpu_bytes, gpu_source = int(gpu_memory_gib * GIB), "--gpu-memory"
    else:
        gpu_bytes, gpu_source = _local_gpu_memory()
    flops = flops_per_step(shape, StepShape.worst(figures.context_tokens_median, figures.block_positions_median, B,
                                                  figures.mean_doc_tokens))
    tps_source = "--tokens-per-s"
    if tokens_per_s is None:
        tokens_per_s = figures.context_tokens_median / (flops / (gpu_tflops * 1e12 * mfu)) if flops else None
        tps_source = f"assumed: {mfu:.0%} MFU of {gpu_tflops:g} dense bf16 TFLOP/s"
    if figures.steps_per_epoch is None:
        notes.append("steps per epoch need the data: pass --cache CACHE")
    if precision.compute_bytes == 4 and device == "cuda":
        notes.append("train.precision = fp32 on a GPU doubles the activations")
    if getattr(cfg.train, "loss", "ce") != "ce":
        notes.append(f"train.loss = {cfg.train.loss}: the loss head holds the teacher's logits too (a second "
                     "vocabulary head per chunk) and the batch its final state; lower train.logits_chunk_rows "
                     "to shrink the head")
    return EstimateReport(shape, t.source, figures, device, attention, peak, median, gpu_bytes, gpu_source, flops,
                          tokens_per_s, tps_source, cfg.train.epochs, notes)


def _loss_terms(cfg: Any, est: MemoryEstimate, shape: DrafterShape, step: StepShape,
                precision: Precision) -> MemoryEstimate:
    """``est`` with the distribution loss's second vocabulary head when ``train.loss`` is not ``ce``."""
    if getattr(cfg.train, "loss", "ce") == "ce":
        return est
    return with_distribution_loss(est, shape, step, precision=precision, chunk_rows=cfg.train.logits_chunk_rows)


def _local_gpu_memory() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory), "this machine's GPU"
    return 80 * 10**9, "assumed 80 GB (no GPU here; pass --gpu-memory)"


def format_report(r: EstimateReport) -> str:
    s, f, p = r.shape, r.figures, r.peak
    lines = [
        f"drafter: {s.layers} layers, hidden {s.hidden}, heads {s.heads}/{s.kv_heads} x {s.head_dim}, MLP "
        f"{s.intermediate}, vocab {s.vocab}, {s.n_features} target layers; {s.params / 1e9:.3f} B trainable "
        f"parameters (teacher shapes from the {r.teacher_source})",
        f"step ({f.source}): block positions median {f.block_positions_median}, max {f.block_positions_max}; "
        f"context tokens median {f.context_tokens_median}, max {f.context_tokens_max}",
        f"device {r.device}, attention {r.attention}; memory at the largest step:",
        f"  weights (fp32 master)          {human(p.weights):>12}",
        f"  gradients (fp32)               {human(p.gradients):>12}",
        f"  optimizer state (fp32)         {human(p.optimizer_state):>12}",
        f"  bf16 weight copies (autocast)  {human(p.autocast_weight_copies):>12}",
        f"  frozen embedding + lm_head     {human(p.frozen_head):>12}",
        f"  batch on the device            {human(p.batch):>12}",
        f"  activations saved for backward {human(p.activations):>12}  ({s.layers} layers"
        f"{', checkpointed: inputs only' if p.recomputed_layer else f', {human(p.per_layer)} per layer'})",
        f"  recomputed layer               {human(p.recomputed_layer):>12}",
        f"  attention workspace            {human(p.attention_workspace):>12}",
        f"  loss head (logits chunk ...)   {human(p.loss_head):>12}",
        f"  one layer's backward           {human(p.backward_working_set):>12}",
        f"  peak: {human(p.device_peak)} (median step {human(r.median.device_peak)}) of {human(r.gpu_memory_bytes)} "
        f"({r.gpu_memory_source}): {'fits' if r.fits else 'DOES NOT FIT'}",
        f"  loader host buffers (host RAM) {human(p.host_loader_buffers):>12}",
        f"compute: {r.flops_per_step / 1e12:.1f} TFLOP per median step",
    ]
    j = r.to_json()
    if r.tokens_per_s:
        lines.append(f"throughput: {r.tokens_per_s:,.0f} tokens/s ({r.tokens_per_s_source})")
    if f.steps_per_epoch is not None:
        lines.append(f"epoch: {f.steps_per_epoch} steps, {f.tokens_per_epoch:,} tokens")
    if j["hours_per_epoch"] is not None:
        lines.append(f"time: {j['hours_per_epoch']:.1f} h per epoch, {j['hours_per_run']:.1f} h for {r.epochs} epochs")
    lines += [f"note: {n}" for n in r.notes]
    if not r.fits:
        lines.append("to fit: lower loader.max_block_positions, set model.activation_checkpointing=true, or lower "
                     "train.logits_chunk_rows")
    return "\n".join(lines)


def check_fits(cfg: Any, cache: Any, device: Any, total: int | None = None) -> None:
    """At the start of training on a GPU: refuse a config whose worst step cannot fit (train.check_memory).
    ``total``: the device's memory (default: asked from CUDA)."""
    import torch

    from dflash_cache.errors import ConfigError

    if device.type != "cuda" or not cfg.train.check_memory:
        return
    if total is None:
        total = int(torch.cuda.get_device_properties(device).total_memory)
    t = teacher_shape(cfg, cache)
    shape = DrafterShape.from_config(cfg.model, t.hidden, t.vocab, t.n_features)
    figures = worst_case_figures(cfg, int(cache.spec.max_length))
    worst = StepShape.worst(figures.context_tokens_max, figures.block_positions_max, shape.block_size,
                            figures.mean_doc_tokens)
    precision = Precision.for_device("cuda", cfg.train.precision)
    est = memory_estimate(shape, worst, precision=precision, attention=attention_kind(cfg.model.attention, "cuda"),
                          checkpointing=cfg.model.activation_checkpointing, chunk_rows=cfg.train.logits_chunk_rows,
                          optimizer=getattr(cfg.train, "optimizer", "adamw"))
    est = _loss_terms(cfg, est, shape, worst, precision)
    if est.device_peak > total:
        raise ConfigError(
            f"the largest step this config allows needs about {human(est.device_peak)} on the GPU, which has "
            f"{human(total)} ({figures.block_positions_max} block positions, {figures.context_tokens_max} context "
            "tokens); lower loader.max_block_positions, set model.activation_checkpointing=true, or lower "
            "train.logits_chunk_rows (see `dflash-train estimate CONFIG`), or --set train.check_memory=false "
            "to start anyway")


def build_parser() -> Any:
    from dflash_cache.runtime.entry import command_parser

    p = command_parser(
        "dflash-train estimate",
        "Predict the peak memory, the compute and the time of one training step and of the whole run from the "
        "config's shapes (and a cache's index with --cache), without loading any weights.",
        "Training runs the same check before it starts on a GPU (train.check_memory).")
    p.add_argument("config", help="TOML preset, e.g. configs/qwen3-8b.toml (keys: docs/config.md)")
    p.add_argument("--cache", help="a feature cache: block positions per step and steps per epoch from its real "
                   "plan (only small index arrays are read)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="device memory to fit in, in GiB "
                   "(default: this machine's GPU, else 80 GB)")
    p.add_argument("--tokens-per-s", type=float, help="measured training throughput, for the time per epoch "
                   "(default: from the FLOPs at --mfu of --gpu-tflops)")
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU in TFLOP/s "
                   "(default 989: H100/H200 SXM)")
    p.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation assumed for the time "
                   "(default 0.35)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the device to size for")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set loader.max_block_positions=32768")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def cli_main(argv: Any = None) -> int:
    import json

    from dflash_cache.runtime.config import load_config

    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    cache = None
    if args.cache:
        from dflash_cache import open_cache

        cache = open_cache(args.cache)
    report = estimate_run(cfg, cache, device=args.device, gpu_memory_gib=args.gpu_memory,
                          tokens_per_s=args.tokens_per_s, gpu_tflops=args.gpu_tflops, mfu=args.mfu)
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    return 0

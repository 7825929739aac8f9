"""``dflash-train estimate``: what one training step costs, before a GPU hour is spent.

The drafter's memory per step is counted from the shapes, term by term, the way this trainer allocates
it (train/models/model.py, train/models/objective.py); nothing is loaded but the config (and the cache's small arrays
when ``--cache`` is given). Activations are in the compute dtype the config chose: the norms keep it under
CUDA autocast too (train/models/model.py ``RMSNorm``) and the loss head never copies the lm_head to fp32 there.
A step's device peak is ``static`` plus the largest of its four phases:

    static     fp32 master weights + optimizer moments + the frozen embedding / lm_head + the batch
    forward    bf16 weight copies (autocast) + activations saved for backward (per block position and per
               context token per layer; only each layer's input with activation checkpointing) + one
               layer's transients
    loss head  the same + the final hidden states, the counted rows and their gradient, one chunk of
               full-vocabulary logits
    backward   the larger of its start (every activation, the loss head's gradient, one layer recomputed
               and its backward working set) and its end (every parameter's gradient alive)
    optimizer  every gradient + the update's temporaries (foreach AdamW on CUDA: one fp32 weight copy)

Host memory: the loader's buffers and a checkpoint's snapshot of weights + optimizer state (kept for reuse
by the next save).

Block positions per step (blocks x block_size) drive the activations; the plan bounds them
(``loader.max_block_positions``) and ``--cache`` reports their real distribution. The same arithmetic is
checked phase by phase against measured peaks of real training steps on CPU, fp32 and bf16 under CUDA
autocast's norm rule (tests/test_estimate.py), and, on a GPU, by ``bench/gpu_check.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from dflash_cache.protocols import ReadableCache

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
    """Bytes per component of one training step (see the module docstring). Device memory is ``static`` plus,
    at each of the step's four phases (:attr:`phases`), what that phase holds; the peak is the largest."""

    weights: int
    gradients: int
    optimizer_state: int
    autocast_weight_copies: int  # bf16 copies of the weights: made in forward, each freed by its layer's backward
    frozen_head: int
    batch: int
    activations: int  # saved for backward through the whole forward (the terms below included)
    per_layer: int  # what one layer saves (all of it without checkpointing)
    recomputed_layer: int  # with activation checkpointing: one layer's activations, rebuilt during backward
    attention_workspace: int  # gradients of one layer's keys and values being formed (in backward_working_set)
    loss_head: int  # the loss head's own memory, on top of the activations
    backward_working_set: int  # one layer's gradients of activations and of its weights (the larger stage)
    host_loader_buffers: int  # host memory, not on the device
    activation_terms: dict[str, int] = field(default_factory=dict)  # what ``activations`` sums, by name
    rope_tables: int = 0  # cos/sin of the block rows' and the context's positions (in activations)
    sdpa_masks: int = 0  # the dense path's additive masks, kept for the whole step (in activations)
    context_activations: int = 0  # fc output, the fused context and its norm: freed only at backward's end
    forward_workspace: int = 0  # a layer's transients in forward: its keys and values before concatenation
    loss_head_residue: int = 0  # what the loss head leaves for backward: its input's gradient [N, H]
    context_gradient: int = 0  # the fused context's gradient, summed over every layer during backward
    optimizer_workspace: int = 0  # the update's temporaries (foreach AdamW: one fp32 copy of the weights)
    checkpoint_snapshot: int = 0  # host memory: the checkpoint's copy of weights + optimizer state
    layer_activations: int = 0  # what the layers save (their inputs only with checkpointing; in activations)
    final_norm_input: int = 0  # the last layer's output, saved by the final norm (in activations)

    @property
    def static(self) -> int:
        """Alive through the whole step: master weights, optimizer moments, frozen head, the batch."""
        return self.weights + self.optimizer_state + self.frozen_head + self.batch

    @property
    def backward_start(self) -> int:
        """Backward's first layer: every activation, the loss head's gradient, one layer's working set (rebuilt
        first with checkpointing) and the bf16 weight copies that no layer's backward has freed yet."""
        return (self.autocast_weight_copies + self.activations + self.loss_head_residue + self.context_gradient
                + self.recomputed_layer + self.backward_working_set)

    @property
    def backward_end(self) -> int:
        """Backward's last part: every parameter's gradient alive, the layers' activations freed, the context's
        activations and gradient still there (fc's backward is last)."""
        return self.gradients + self.context_activations + self.context_gradient + self.rope_tables + self.sdpa_masks

    @property
    def phases(self) -> dict[str, int]:
        """Device bytes above ``static`` at each phase's high-water mark: the forward (at its last layer), the
        loss head, the backward (gradients alive: the larger of its start and its end) and the optimizer
        update (every gradient, no activation)."""
        held = self.autocast_weight_copies + self.activations
        return {
            "forward": held + self.forward_workspace,
            "loss_head": held + self.loss_head,
            "backward": max(self.backward_start, self.backward_end),
            "optimizer": self.gradients + self.optimizer_workspace,
        }

    @property
    def dynamic_peak(self) -> int:
        return max(self.phases.values())

    @property
    def device_peak(self) -> int:
        return self.static + self.dynamic_peak

    @property
    def host_peak(self) -> int:
        """Host memory: the loader's buffers and, once a checkpoint is taken, its snapshot (kept for reuse)."""
        return self.host_loader_buffers + self.checkpoint_snapshot

    def as_dict(self) -> dict[str, int]:
        out = dict(asdict(self))
        out.update(static=self.static, dynamic_peak=self.dynamic_peak, device_peak=self.device_peak,
                   host_peak=self.host_peak, backward_start=self.backward_start, backward_end=self.backward_end)
        return out


def optimizer_state_bytes(shape: DrafterShape, optimizer: Optimizer) -> int:
    """AdamW: two fp32 moments per parameter. Muon: one fp32 momentum per 2-D weight, AdamW's two for the rest."""
    two_d, other = shape.param_counts()
    if optimizer == "muon":
        return 4 * two_d + 8 * other
    return 8 * (two_d + other)


def optimizer_workspace_bytes(shape: DrafterShape, optimizer: Optimizer, foreach: bool) -> int:
    """The update's temporaries. foreach AdamW (the default on CUDA) forms sqrt(v) for every parameter at once:
    one fp32 copy of the weights; the per-parameter loop (CPU) and Muon hold a few copies of the largest one."""
    H, d = shape.hidden, shape.head_dim
    largest = max(shape.n_features * H * H, H * shape.intermediate, H * shape.heads * d)
    if foreach and optimizer == "adamw":
        return 4 * shape.params
    return 3 * 4 * largest


def memory_estimate(shape: DrafterShape, step: StepShape, *, precision: Precision = Precision(),
                    attention: Literal["flex", "sdpa"] = "flex", checkpointing: bool = False,
                    chunk_rows: int = 2048, optimizer: Optimizer = "adamw", loader_host_bytes: int = 0,
                    foreach_optimizer: bool = True) -> MemoryEstimate:
    """One training step's memory, term by term, as train/models/model.py and train/models/objective.py allocate it.

    Every activation is in the compute dtype ``c`` (bf16 under autocast: the norms keep their input's dtype,
    see ``RMSNorm``), except the norms' fp32 scale per row and the attention's fp32 log-sum-exp."""
    H, V, B, c = shape.hidden, shape.vocab, shape.block_size, precision.compute_bytes
    C, Q, N = step.context_tokens, step.blocks * B, step.counted_rows
    F = shape.n_features * H
    d, heads, kvh, inter = shape.head_dim, shape.heads, shape.kv_heads, shape.intermediate
    qd, kvd = heads * d, kvh * d
    P = shape.params

    weights = P * precision.param_bytes
    autocast_copies = P * 2 if precision.autocast else 0
    head = V * H * precision.head_bytes * (1 if shape.tied_head else 2)
    batch = C * (F * 2 + 8 + 1 + 4 + 8)  # bf16 features; input_ids, loss_mask, doc_ids, position_ids

    # saved per block row of one layer (elements): the residual stream entering each norm (input, post
    # attention) and the norms' outputs (inputs of the projections); q before its norm, after it and its
    # rotated half (RoPE), the attention's q; the block rows' k before its norm, after it and its rotated
    # half, their k and v in the keys; the attention output and its [Q, n*d] copy for o_proj; the MLP's gate,
    # silu(gate), up and their product. Per context token: the same for its k (norm, RoPE) and k, v in the keys.
    per_q = 4 * H + (3 * qd + qd) + 3 * kvd + 2 * kvd + 2 * qd + 4 * inter
    per_c = 3 * kvd + 2 * kvd
    norm_rows = Q * (2 + heads + kvh) + C * kvh  # one fp32 scale per normalised row
    attn_lse = heads * Q * 4  # the attention kernel's fp32 log-sum-exp
    layer_full = (per_q * Q + per_c * C) * c + norm_rows * 4 + attn_lse
    layers_saved = shape.layers * (Q * H * c if checkpointing else layer_full)  # inputs only when checkpointing

    rope = 2 * (C + Q) * d * c  # cos and sin [L, d] of the block rows' and the context's positions
    # the dense path (SDPA, row by row) keeps one additive mask [Q_r, T + Q_r] per row and layer kind for the
    # whole step: Q x (T + Q / rows) in all for rows of equal blocks
    T = C // max(1, step.rows)
    mask = (1 + int(shape.sliding_layers > 0)) * Q * (T + Q // max(1, step.rows)) * c if attention == "sdpa" else 0
    # fc's output (hidden_norm's input), the fused context, hidden_norm's scales (+ the features converted to
    # fp32 for fc when not under autocast)
    context = 2 * C * H * c + C * 4 + (C * F * 4 if not precision.autocast else 0)
    final = Q * H * c + Q * 4  # the final norm's input (its output is the loss head's, below)
    terms = dict(layers=layers_saved, context=context, rope=rope, sdpa_mask=mask, final_norm=final)
    activations = sum(terms.values())

    # forward transients at a layer: k and v of the context and of the block rows before concatenation, and
    # (SDPA) the concatenated keys it slices per row; with checkpointing, also the layer's unsaved inside:
    # the MLP's silu(gate), up and their product, and the residual stream around it
    forward_ws = (2 + (2 if attention == "sdpa" else 0)) * (C + Q) * kvd * c
    if checkpointing:
        forward_ws = max(forward_ws, (3 * Q * inter + 2 * Q * H) * c)

    # the loss head: the final norm's output [Q, H], the counted rows gathered [N, H] and their gradient
    # [N, H]; one chunk of full-vocabulary logits (the matmul's output in the compute dtype, then fp32, and
    # the softmax back in the compute dtype for the gradient); the lm_head cast to the compute dtype when it
    # is stored otherwise (fp32 compute only: under autocast it is used as stored)
    chunk = min(chunk_rows, max(N, 1))
    chunk_logits = chunk * V * (4 + (c if c != 4 else 0))
    head_cast = V * H * c if (precision.head_bytes != c and not precision.autocast) else 0
    loss_head = Q * H * c + 2 * N * H * c + chunk_logits + head_cast
    loss_residue = N * H * c

    gradients = P * precision.param_bytes
    # one layer's backward (the last layer's, the first to run): its weights' gradients form while the
    # activations it saved are freed, each as the node that used it runs. Under autocast a weight's gradient is
    # formed in the compute dtype and converted to the fp32 .grad, and the matmul that saved the weight's bf16
    # copy (in autocast_weight_copies) frees it: net fp32 - bf16 per weight, plus one matrix's bf16 gradient
    # while it is converted (not bf16 + fp32 of every weight on top of the copies). Two stages, the larger
    # counts: the MLP's, one [H, I] gradient with its activations' gradients [Q, I] and [Q, H] (measured: about
    # one of each net); the attention's, every weight of the layer with a gradient, by when the MLP's saved
    # activations (gate, silu(gate), up, their product: 4 [Q, I]) and the post-attention norm's input and
    # output (2 [Q, H]) are freed, plus the keys' and values' gradients.
    two_d, _ = shape.param_counts()
    layer_weights = (two_d - shape.n_features * H * H) // max(1, shape.layers)

    def weight_grads(n: int, largest: int) -> int:
        if precision.autocast:
            return n * (precision.param_bytes - 2) + largest * 2
        return n * precision.param_bytes

    attention_ws = 3 * (C + Q) * kvd * c  # gradients of k and v (and q) being formed
    mlp_stage = weight_grads(H * inter, H * inter) + (Q * inter + Q * H) * c
    attention_stage = (weight_grads(layer_weights, max(H * qd, H * kvd)) - (4 * Q * inter + 2 * Q * H) * c
                       + attention_ws)
    backward_ws = max(mlp_stage, attention_stage)
    context_grad = C * H * c
    opt = optimizer_state_bytes(shape, optimizer)
    return MemoryEstimate(
        weights=weights, gradients=gradients, optimizer_state=opt, autocast_weight_copies=autocast_copies,
        frozen_head=head, batch=batch, activations=activations, per_layer=layer_full,
        recomputed_layer=layer_full if checkpointing else 0,
        attention_workspace=attention_ws, loss_head=loss_head, backward_working_set=backward_ws,
        host_loader_buffers=loader_host_bytes, activation_terms=terms, rope_tables=rope, sdpa_masks=mask, context_activations=context,
        forward_workspace=forward_ws, loss_head_residue=loss_residue, context_gradient=context_grad,
        optimizer_workspace=optimizer_workspace_bytes(shape, optimizer, foreach_optimizer),
        checkpoint_snapshot=weights + opt, layer_activations=layers_saved, final_norm_input=final,
    )


def dflash2_params(shape: DrafterShape, model_cfg: Any) -> tuple[int, int]:
    """(2-D, other) parameters DFlash2 adds: per layer two convolutions (``kernel_projection`` [2*K*G, H] 2-D,
    ``base_kernel`` [2, K, H]), and the selector (two [V, r] codebooks, ``hidden_projection`` [r, H])."""
    H, K, r = shape.hidden, model_cfg.conv_kernel_size, model_cfg.selector_rank
    G = H // model_cfg.conv_group_size
    two_d = shape.layers * 2 * (H * 2 * K * G) + 2 * shape.vocab * r + H * r
    return two_d, shape.layers * 2 * (2 * K * H)


def with_dflash2_terms(est: MemoryEstimate, shape: DrafterShape, step: StepShape, model_cfg: Any, *,
                       precision: Precision, checkpointing: bool, optimizer: Optimizer, chunk_rows: int
                       ) -> MemoryEstimate:
    """``est`` plus what ``model.arch = "dflash2"`` adds (train.models.dflash2), term by term:

    * weights, gradients, optimizer state and autocast copies of :func:`dflash2_params`;
    * per layer and block position, four convolutions each saving its K-1 shifted inputs, its output and its
      taps (the input of the first is already the norm's output): ``4 (K + 1) H + 4 (2 K G)`` elements;
    * the loss head: the top-K values and ids [N, K] (fp32 + int64), the rescored candidates and their
      softmax (3 x [N, K] fp32), the gathered successor codes [N, K, r] (fp32, kept for backward), and in the
      backward the candidates' gathered lm_head rows (at most a logits chunk's bytes at a time)."""
    H, V, c = shape.hidden, shape.vocab, precision.compute_bytes
    K, k_sel, r = model_cfg.conv_kernel_size, min(model_cfg.selector_top_k, V), model_cfg.selector_rank
    G = H // model_cfg.conv_group_size
    Q, N = step.blocks * shape.block_size, step.counted_rows
    two_d, other = dflash2_params(shape, model_cfg)
    P = two_d + other
    opt = 4 * two_d + 8 * other if optimizer == "muon" else 8 * P
    per_layer = (4 * (K + 1) * H + 4 * 2 * K * G) * Q * c
    selector_head = N * k_sel * (4 + 8 + 3 * 4 + r * 4) + min(chunk_rows, max(N, 1)) * V * 4
    return replace(
        est, weights=est.weights + P * precision.param_bytes, gradients=est.gradients + P * precision.param_bytes,
        optimizer_state=est.optimizer_state + opt,
        autocast_weight_copies=est.autocast_weight_copies + (P * 2 if precision.autocast else 0),
        activations=est.activations + (0 if checkpointing else shape.layers * per_layer),
        per_layer=est.per_layer + per_layer,
        recomputed_layer=est.recomputed_layer + (per_layer if checkpointing else 0),
        loss_head=est.loss_head + selector_head,
    )


def with_distribution_loss(est: MemoryEstimate, shape: DrafterShape, step: StepShape, *,
                           precision: Precision = Precision(), chunk_rows: int = 2048) -> MemoryEstimate:
    """``est`` under a distribution loss (``train.loss`` kl / tv / lk_*, train/models/distill.py): the batch carries the
    teacher's final state (one more H-wide bf16 slot per context token); the loss head gathers the counted
    rows' teacher states (bf16, and in the compute dtype) and holds, per chunk, the second vocabulary head:
    the drafter's and the teacher's fp32 logits, the teacher's probabilities and one more fp32 [chunk, V]
    temporary (four in all, plus a logits matmul output in the compute dtype), in place of CE's one."""
    H, V, c = shape.hidden, shape.vocab, precision.compute_bytes
    N = step.counted_rows
    chunk = min(chunk_rows, max(N, 1))
    head_cast = V * H * c if (precision.head_bytes != c and not precision.autocast) else 0
    teacher_rows = N * H * (2 + (c if c != 2 else 0))
    # as memory_estimate's loss head (the final norm's output [Q, H], the counted rows and their gradient), plus
    # the teacher's rows and the second vocabulary head's chunk
    Q = step.blocks * shape.block_size
    loss_head = Q * H * c + 2 * N * H * c + teacher_rows + chunk * V * (16 + (c if c != 4 else 0)) + head_cast
    return replace(est, batch=est.batch + step.context_tokens * H * 2, loss_head=loss_head)


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


def teacher_shape(cfg: Any, cache: ReadableCache | None) -> TeacherShape:
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


def plan_figures(cfg: Any, cache: ReadableCache) -> PlanFigures:
    """Epoch 0's plan over the cache, as the trainer's loader would make it (index arrays only; no feature
    is read)."""
    import numpy as np

    from ..data.plan import plan_from_index

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
            "host_peak_bytes": self.peak.host_peak,
            "drafter_params": self.shape.params, "teacher_shapes_from": self.teacher_source,
            "device": self.device, "attention": self.attention, "flops_per_step": self.flops_per_step,
            "steps_per_epoch": f.steps_per_epoch, "tokens_per_epoch": f.tokens_per_epoch,
            "tokens_per_s": self.tokens_per_s, "tokens_per_s_source": self.tokens_per_s_source,
            "hours_per_epoch": epoch_h, "hours_per_run": epoch_h * self.epochs if epoch_h is not None else None,
            "notes": self.notes,
        }


def estimate_run(cfg: Any, cache: ReadableCache | None = None, *, device: str = "cuda", gpu_memory_gib: float | None = None,
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
                              optimizer=getattr(cfg.train, "optimizer", "adamw"), loader_host_bytes=host,
                              foreach_optimizer=device == "cuda")
        return _family_and_loss_terms(cfg, est, shape, step, precision)

    peak = at(figures.block_positions_max, figures.context_tokens_max)
    median = at(figures.block_positions_median, figures.context_tokens_median)
    if gpu_memory_gib is not None:
        gpu_bytes, gpu_source = int(gpu_memory_gib * GIB), "--gpu-memory"
    elif device == "cpu":  # the step lives in host RAM: compare with it, not with a GPU
        gpu_bytes, gpu_source = _host_memory(), "this machine's RAM (--device cpu)"
    else:
        gpu_bytes, gpu_source = _local_gpu_memory()
    flops = flops_per_step(shape, StepShape.worst(figures.context_tokens_median, figures.block_positions_median, B,
                                                  figures.mean_doc_tokens))
    tps_source = "--tokens-per-s"
    if tokens_per_s is None and device == "cpu":  # a GPU's TFLOP/s say nothing about a CPU
        notes.append("no throughput on CPU without a measurement: pass --tokens-per-s (train/tokens_per_s of a "
                     "short run's metrics.jsonl)")
    elif tokens_per_s is None:
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


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parameter_count(n: int) -> str:
    """``1.234 B`` / ``5.67 M`` / ``890 k``: a drafter's size readable at every scale."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def _family_and_loss_terms(cfg: Any, est: MemoryEstimate, shape: DrafterShape, step: StepShape,
                           precision: Precision) -> MemoryEstimate:
    """``est`` with DFlash2's terms (``model.arch = dflash2``) and the distribution loss's second vocabulary
    head (``train.loss`` other than ``ce``)."""
    if cfg.model.arch == "dflash2":
        est = with_dflash2_terms(est, shape, step, cfg.model, precision=precision,
                                 checkpointing=cfg.model.activation_checkpointing,
                                 optimizer=getattr(cfg.train, "optimizer", "adamw"),
                                 chunk_rows=cfg.train.logits_chunk_rows)
    if getattr(cfg.train, "loss", "ce") != "ce":
        est = with_distribution_loss(est, shape, step, precision=precision, chunk_rows=cfg.train.logits_chunk_rows)
    return est


def _local_gpu_memory() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory), "this machine's GPU"
    return 80 * 10**9, "assumed 80 GB (no GPU here; pass --gpu-memory)"


def format_report(r: EstimateReport) -> str:
    s, f, p = r.shape, r.figures, r.peak
    lines = [
        f"drafter: {s.layers} layers, hidden {s.hidden}, heads {s.heads}/{s.kv_heads} x {s.head_dim}, MLP "
        f"{s.intermediate}, vocab {s.vocab}, {s.n_features} target layers; {parameter_count(s.params)} trainable "
        f"parameters (teacher shapes from the {r.teacher_source})",
        f"step ({f.source}): block positions median {f.block_positions_median}, max {f.block_positions_max}; "
        f"context tokens median {f.context_tokens_median}, max {f.context_tokens_max}",
        f"device {r.device}, attention {r.attention}; memory at the largest step:",
        f"  weights (fp32 master)          {human(p.weights):>12}",
        f"  gradients (fp32)               {human(p.gradients):>12}",
        f"  optimizer state (fp32)         {human(p.optimizer_state):>12}",
        f"  bf16 weight copies (autocast)  {human(p.autocast_weight_copies):>12}  (until each layer's backward)",
        f"  frozen embedding + lm_head     {human(p.frozen_head):>12}",
        f"  batch on the device            {human(p.batch):>12}",
        f"  activations saved for backward {human(p.activations):>12}  ({s.layers} layers"
        f"{', checkpointed: inputs only' if p.recomputed_layer else f', {human(p.per_layer)} per layer'})",
        f"  recomputed layer               {human(p.recomputed_layer):>12}",
        f"  loss head (logits chunk ...)   {human(p.loss_head):>12}",
        f"  one layer's backward           {human(p.backward_working_set):>12}  (gradients of its weights and activations;"
        f" attention workspace {human(p.attention_workspace)} of it)",
        f"  static (weights, moments, head, batch) {human(p.static)}; on top of it, per phase: "
        + ", ".join(f"{k.replace('_', ' ')} {human(v)}" for k, v in p.phases.items()),
        f"  peak: {human(p.device_peak)} (median step {human(r.median.device_peak)}) of {human(r.gpu_memory_bytes)} "
        f"({r.gpu_memory_source}): {'fits' if r.fits else 'DOES NOT FIT'}",
        f"  loader host buffers (host RAM) {human(p.host_loader_buffers):>12}",
        f"  checkpoint snapshot (host RAM) {human(p.checkpoint_snapshot):>12}  (weights + optimizer state, kept "
        f"for the next save); host peak {human(p.host_peak)}",
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


def check_fits(cfg: Any, cache: ReadableCache, device: Any, total: int | None = None) -> None:
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
                          optimizer=getattr(cfg.train, "optimizer", "adamw"), foreach_optimizer=True)
    est = _family_and_loss_terms(cfg, est, shape, worst, precision)
    if est.device_peak > total:
        raise ConfigError(
            f"the largest step this config allows needs about {human(est.device_peak)} on the GPU, which has "
            f"{human(total)} ({figures.block_positions_max} block positions, {figures.context_tokens_max} context "
            "tokens); lower loader.max_block_positions, set model.activation_checkpointing=true, or lower "
            "train.logits_chunk_rows (see `dflash-train estimate CONFIG`), or --set train.check_memory=false "
            "to start anyway")


def build_parser() -> Any:
    from dflash_cache.runtime.entry import command_parser, finite_float

    p = command_parser(
        "dflash-train estimate",
        "Predict the peak memory, the compute and the time of one training step and of the whole run from the "
        "config's shapes (and a cache's index with --cache), without loading any weights.",
        "Training runs the same check before it starts on a GPU (train.check_memory).")
    p.add_argument("config", help="TOML preset, e.g. configs/qwen3-8b.toml (keys: docs/config.md)")
    p.add_argument("--cache", help="a feature cache: block positions per step and steps per epoch from its real "
                   "plan (only small index arrays are read)")
    p.add_argument("--gpu-memory", type=finite_float, metavar="GIB", help="device memory to fit in, in GiB "
                   "(default: this machine's GPU, else 80 GB)")
    p.add_argument("--tokens-per-s", type=finite_float, help="measured training throughput, for the time per epoch "
                   "(default: from the FLOPs at --mfu of --gpu-tflops)")
    p.add_argument("--gpu-tflops", type=finite_float, default=989.0, help="dense bf16 peak of the GPU in TFLOP/s "
                   "(default 989: H100/H200 SXM)")
    p.add_argument("--mfu", type=finite_float, default=0.35, help="model FLOPs utilisation assumed for the time "
                   "(default 0.35)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the device to size for")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set loader.max_block_positions=32768")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def cli_main(argv: Any = None) -> int:
    import json

    from dflash_cache.runtime.config import load_config
    from dflash_cache.runtime.schema import TRAIN_COMMAND

    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides, command=TRAIN_COMMAND)
    cache = None
    if args.cache:
        from dflash_cache import open_cache

        cache = open_cache(args.cache)
    report = estimate_run(cfg, cache, device=args.device, gpu_memory_gib=args.gpu_memory,
                          tokens_per_s=args.tokens_per_s, gpu_tflops=args.gpu_tflops, mfu=args.mfu)
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    return 0

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
    """One step's data: context tokens C (rows x padded length), blocks A, counted block rows N."""

    context_tokens: int
    blocks: int
    counted_rows: int

    @classmethod
    def worst(cls, context_tokens: int, block_positions: int, block_size: int) -> StepShape:
        blocks = block_positions // block_size
        return cls(context_tokens, blocks, blocks * (block_size - 1))


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
    # the dense path (SDPA) keeps one additive float mask [Q, K] per layer kind for the whole step
    mask = (1 + int(shape.sliding_layers > 0)) * Q * K * c if attention == "sdpa" else 0
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
        frozen_head=head, batch=batch, activations=activations, recomputed_layer=layer_full if checkpointing else 0,
        attention_workspace=attention_ws, loss_head=loss_head, backward_working_set=backward_ws,
        host_loader_buffers=loader_host_bytes,
    )


def flops_per_step(shape: DrafterShape, step: StepShape, checkpointing: bool = False) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward; the recomputed forward of
    activation checkpointing is not counted, as MFU conventions go). Matmuls only."""
    H, B = shape.hidden, shape.block_size
    C, Q = step.context_tokens, step.blocks * B
    qd, kvd = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    fc = 2 * C * shape.n_features * H * H
    per_layer_q = 2 * Q * (H * qd * 2 + H * kvd * 2 + 3 * H * shape.intermediate)  # q,o; k,v; mlp
    per_layer_c = 2 * C * (H * kvd * 2)  # the context's k and v
    # attention: each block row attends to (on average) half its document's context before the anchor + B
    attn = 2 * 2 * Q * qd * (B + C / max(1, 2 * max(1, step.blocks // max(1, shape.block_size))))
    head = 2 * step.counted_rows * H * shape.vocab
    fwd = fc + shape.layers * (per_layer_q + per_layer_c + attn) + head
    return 3.0 * fwd


def fits(peak_bytes: int, device_bytes: int) -> bool:
    return peak_bytes <= device_bytes


def human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def max_block_positions_bound(tokens_per_batch: int, max_length: int, num_anchors: int, block_size: int,
                              budget: int) -> tuple[int, int]:
    """(block positions, documents of the worst batch) the plan can produce: documents of length L give
    floor(tokens / L) documents of min(num_anchors, L - 1) blocks, capped by ``budget``."""
    best = (0, 0)
    for L in range(2, max(2, max_length) + 1):
        docs = tokens_per_batch // L
        if docs == 0:
            break
        pos = docs * min(num_anchors, L - 1) * block_size
        if pos > best[0]:
            best = (pos, docs)
    return min(best[0], budget), best[1]


def attention_kind(requested: str, device_type: str) -> Literal["flex", "sdpa"]:
    if requested in ("flex", "sdpa"):
        return requested  # type: ignore[return-value]
    return "flex" if device_type == "cuda" else "sdpa"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else 0


def run_hours(tokens: float, tokens_per_s: float) -> float:
    return tokens / tokens_per_s / 3600 if tokens_per_s > 0 else math.inf

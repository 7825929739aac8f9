"""The DFlash training mask and the two attention paths that apply it.

Keys of every drafter layer are ``[context (T positions) | block 0 | block 1 | ... ]`` and queries
are the block rows only. Block ``n`` is anchored at context position ``a_n`` and occupies absolute
positions ``a_n .. a_n + B - 1``. The rules (each one a test):

* a block sees context positions **strictly before** its anchor, and only those of the anchor's own
  document (packed rows hold several documents);
* a block never sees another block;
* within a block attention is bidirectional for full-attention layers and causal for
  sliding-window layers, which also see only keys less than ``sliding_window`` positions behind
  the query;
* an invalid (padding) block sees only itself, so no query row is fully masked (a fully masked
  row makes SDPA return NaN, which would poison the gradient even at loss weight 0).

:class:`BlockLayout` describes the blocks of one batch once; each layer asks it for a dense boolean
mask (SDPA, CPU) or a FlexAttention ``BlockMask`` (GPU). Both encode the same predicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

AttentionBackend = Literal["sdpa", "flex"]


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch < 2.5
        return False
    return True


def resolve_backend(requested: str, device: torch.device) -> AttentionBackend:
    """``auto`` means FlexAttention on CUDA (fused kernel) and SDPA with a dense mask elsewhere."""
    if requested == "sdpa":
        return "sdpa"
    if requested == "flex":
        if not flex_available():
            raise RuntimeError("model.attention = 'flex' needs torch >= 2.5 (FlexAttention); use 'sdpa'")
        return "flex"
    return "flex" if device.type == "cuda" and flex_available() else "sdpa"


@dataclass
class BlockLayout:
    """Where the blocks of one batch sit in their rows.

    anchors: [R, N] int64 context index of each block's anchor (any in-range value when invalid)
    valid:   [R, N] bool, False for padding blocks
    doc_ids: [R, T] int, document of each context position (-1 on padding)
    """

    anchors: Tensor
    valid: Tensor
    doc_ids: Tensor
    block_size: int
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.anchors.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.shape[1])

    @property
    def context_len(self) -> int:
        return int(self.doc_ids.shape[1])

    @property
    def anchor_docs(self) -> Tensor:
        """[R, N] document of each anchor."""
        return torch.gather(self.doc_ids, 1, self.anchors.clamp(0, self.context_len - 1))

    def dense(self, causal: bool, window: int | None) -> Tensor:
        """Boolean mask [R, 1, N*B, T + N*B] (True = may attend), cached per layer kind."""
        key = ("dense", causal, window)
        if key not in self._cache:
            self._cache[key] = _dense_mask(self, causal, window)
        return self._cache[key]

    def flex(self, causal: bool, window: int | None) -> Any:
        """FlexAttention ``BlockMask`` with the same predicate as :meth:`dense`, cached per layer kind."""
        key = ("flex", causal, window)
        if key not in self._cache:
            self._cache[key] = _flex_mask(self, causal, window)
        return self._cache[key]


def _dense_mask(layout: BlockLayout, causal: bool, window: int | None) -> Tensor:
    R, N, B, T = layout.num_rows, layout.num_blocks, layout.block_size, layout.context_len
    device = layout.anchors.device
    pos = torch.arange(T, device=device)  # [T]
    anchors = layout.anchors  # [R, N]
    ctx = (pos.view(1, 1, T) < anchors.unsqueeze(-1)) & (
        layout.doc_ids.unsqueeze(1) == layout.anchor_docs.unsqueeze(-1)
    )  # [R, N, T]
    ctx = ctx & layout.valid.unsqueeze(-1)
    ctx = ctx.unsqueeze(2).expand(R, N, B, T)  # [R, N, B, T]
    if window is not None:
        row = torch.arange(B, device=device).view(1, 1, B, 1)
        ctx = ctx & ((anchors.view(R, N, 1, 1) + row - pos.view(1, 1, 1, T)) < window)
    inner = _within_block(B, causal, window, device)  # [B, B]
    eye = torch.eye(N, dtype=torch.bool, device=device)  # [N, N]
    blocks = (eye.view(N, 1, N, 1) & inner.view(1, B, 1, B)).reshape(N * B, N * B)
    mask = torch.cat([ctx.reshape(R, N * B, T), blocks.unsqueeze(0).expand(R, -1, -1)], dim=2)
    return mask.unsqueeze(1)  # [R, 1, N*B, T + N*B]


def _within_block(B: int, causal: bool, window: int | None, device: torch.device) -> Tensor:
    i = torch.arange(B, device=device).view(B, 1)
    j = torch.arange(B, device=device).view(1, B)
    inner = torch.ones(B, B, dtype=torch.bool, device=device)
    if causal:
        inner &= j <= i
    if window is not None:
        inner &= (i - j) < window
        if not causal:
            inner &= (j - i) < window
    return inner


def _flex_mask(layout: BlockLayout, causal: bool, window: int | None) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    R, N, B, T = layout.num_rows, layout.num_blocks, layout.block_size, layout.context_len
    anchors, valid, doc_ids = layout.anchors, layout.valid, layout.doc_ids
    anchor_docs = layout.anchor_docs

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        n = q_idx // B
        i = q_idx % B
        anchor = anchors[b, n]
        is_ctx = kv_idx < T
        ctx_ok = is_ctx & (kv_idx < anchor) & valid[b, n]
        ctx_ok = ctx_ok & (doc_ids[b, kv_idx.clamp(max=T - 1)] == anchor_docs[b, n])
        kb = (kv_idx - T).clamp(min=0)
        j = kb % B
        blk_ok = (~is_ctx) & (kb // B == n)
        if causal:
            blk_ok = blk_ok & (j <= i)
        if window is not None:
            ctx_ok = ctx_ok & ((anchor + i - kv_idx) < window)
            blk_ok = blk_ok & ((i - j) < window)
            if not causal:
                blk_ok = blk_ok & ((j - i) < window)
        return ctx_ok | blk_ok

    return create_block_mask(
        mask_mod, B=R, H=None, Q_LEN=N * B, KV_LEN=T + N * B, device=str(anchors.device),
        _compile=anchors.is_cuda,  # compiled on GPU: never materializes the [Q, KV] mask
    )


_compiled_flex: Any = None


def _flex_fn() -> Any:
    """FlexAttention, compiled on CUDA (the fused kernel); eager elsewhere (materializes scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if not torch.cuda.is_available():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def attend(
    q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, *, causal: bool, window: int | None,
    backend: AttentionBackend, scale: float,
) -> Tensor:
    """q [R, Hq, Q, D], k/v [R, Hkv, K, D] -> [R, Hq, Q, D] under the layout's mask."""
    gqa = q.shape[1] != k.shape[1]
    if backend == "flex":
        block_mask = layout.flex(causal, window)
        return _flex_fn()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    mask = layout.dense(causal, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)

"""The DFlash training mask and the two attention paths that apply it.

The rows of a batch are flattened into one context of ``C = R * T`` positions (padding included; it is
never visible). Queries are the block rows only, ``A`` blocks of ``B`` rows each, one block per sampled
anchor (no padding blocks); keys of every drafter layer are ``[context (C) | block 0 | block 1 | ...]``.
Block ``n`` is anchored at flat context index ``anchors[n]`` and occupies document positions
``p .. p + B - 1`` where ``p`` is the anchor's position in its document. The rules (each one a test):

* a block sees context positions **strictly before** its anchor, and only those of the anchor's own
  document (a row may hold several packed documents; rows are different documents too);
* a block never sees another block;
* within a block every row sees every other row (bidirectional), in every layer type, as in the
  DFlash reference and the serving engines. ``within_block = "causal"`` (for sliding-window layers,
  ``model.sliding_within_block``) makes row ``i`` see rows ``j <= i`` only;
* a sliding-window layer also sees only keys less than ``window`` positions away from the query
  (document positions): context keys behind it, and (when ``window < B``) block rows on either side, as the
  serving engines' symmetric window does.

No query row is ever fully masked: each block row sees at least itself.

:class:`BlockLayout` describes the blocks of one batch once; each layer asks it for a FlexAttention
``BlockMask`` (GPU: masked tiles are skipped) or, for SDPA (CPU), one dense additive mask per row of the batch:
a block only ever sees its own row, so SDPA runs row by row over ``[row context | row's blocks]`` instead of
densely over the whole flattened batch. Both encode the same predicate (:meth:`BlockLayout.dense`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

AttentionBackend = Literal["sdpa", "flex"]
WithinBlock = Literal["bidirectional", "causal"]


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


def global_doc_ids(doc_ids: Tensor) -> Tensor:
    """[R, T] per-row document ids (-1 padding) -> [R*T] ids unique across rows (-1 padding)."""
    R, T = doc_ids.shape
    per_row = int(doc_ids.max().item()) + 1 if doc_ids.numel() else 1
    rows = torch.arange(R, device=doc_ids.device, dtype=torch.int64).unsqueeze(1) * max(per_row, 1)
    return torch.where(doc_ids >= 0, rows + doc_ids.long(), torch.full_like(rows + doc_ids.long(), -1)).reshape(-1)


@dataclass
class BlockLayout:
    """Where the blocks of one batch sit in its flattened context.

    anchors:   [A] int64 flat context index of each block's anchor (ascending)
    ctx_doc:   [C] int64 document of each context position, unique across rows (-1 on padding)
    ctx_pos:   [C] int64 position of each context position within its document
    """

    anchors: Tensor
    ctx_doc: Tensor
    ctx_pos: Tensor
    block_size: int
    row_tokens: int | None = None  # T: the context is R rows of T positions (None: one row)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def row_segments(self) -> list[tuple[int, int, int]]:
        """``(row, first block, end block)`` per row holding blocks (anchors are sorted: a row's are contiguous)."""
        if "segments" not in self._cache:
            T = self.row_tokens or self.context_len
            rows = (self.anchors // T).tolist()
            out, start = [], 0
            for end in range(1, len(rows) + 1):
                if end == len(rows) or rows[end] != rows[start]:
                    out.append((rows[start], start, end))
                    start = end
            self._cache["segments"] = out
        return self._cache["segments"]

    def to(self, device: torch.device) -> BlockLayout:
        """The layout on ``device``; its row segments are worked out where the anchors are now (no copy back)."""
        segments = self.row_segments()
        moved = BlockLayout(self.anchors.to(device), self.ctx_doc.to(device), self.ctx_pos.to(device),
                            self.block_size, self.row_tokens)
        moved._cache["segments"] = segments
        return moved

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.shape[0])

    @property
    def context_len(self) -> int:
        return int(self.ctx_doc.shape[0])

    @property
    def anchor_doc(self) -> Tensor:
        """[A] document of each anchor."""
        return self.ctx_doc[self.anchors]

    @property
    def anchor_pos(self) -> Tensor:
        """[A] position of each anchor within its document."""
        return self.ctx_pos[self.anchors]

    def dense(self, within_block: WithinBlock, window: int | None) -> Tensor:
        """Boolean mask [1, 1, A*B, C + A*B] (True = may attend), cached per layer kind."""
        key = ("dense", within_block, window)
        if key not in self._cache:
            self._cache[key] = _dense_mask(self, within_block, window)
        return self._cache[key]

    def additive(self, within_block: WithinBlock, window: int | None, dtype: torch.dtype) -> Tensor:
        """The dense mask as an additive float mask (0 / -inf) in ``dtype``, cached per layer kind. SDPA keeps
        a float mask by reference; a boolean one it converts into a new float copy per call, and every
        layer's copy stays alive until backward."""
        key = ("additive", within_block, window, dtype)
        if key not in self._cache:
            allowed = _dense_mask(self, within_block, window)
            self._cache[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._cache[key]

    def row_masks(self, within_block: WithinBlock, window: int | None, dtype: torch.dtype
                  ) -> list[tuple[int, int, int, int, Tensor]]:
        """Per row holding blocks: ``(context start, context end, first block, end block, additive mask
        [1, 1, Q_r, T + Q_r])``, cached per layer kind. Blocks are sorted by anchor, so a row's are contiguous."""
        key = ("rows", within_block, window, dtype)
        if key not in self._cache:
            T = self.row_tokens or self.context_len
            out = []
            for row, start, end in self.row_segments():
                c0 = row * T
                sub = BlockLayout(self.anchors[start:end] - c0, self.ctx_doc[c0:c0 + T], self.ctx_pos[c0:c0 + T],
                                  self.block_size)
                out.append((c0, c0 + T, start, end, sub.additive(within_block, window, dtype)))
            self._cache[key] = out
        return self._cache[key]

    def flex(self, within_block: WithinBlock, window: int | None) -> Any:
        """FlexAttention ``BlockMask`` with the same predicate as :meth:`dense`, cached per layer kind."""
        key = ("flex", within_block, window)
        if key not in self._cache:
            self._cache[key] = _flex_mask(self, within_block, window)
        return self._cache[key]


def _dense_mask(layout: BlockLayout, within_block: WithinBlock, window: int | None) -> Tensor:
    A, B, C = layout.num_blocks, layout.block_size, layout.context_len
    device = layout.anchors.device
    kv = torch.arange(C, device=device)  # [C]
    ctx = (kv.view(1, C) < layout.anchors.view(A, 1)) & (layout.ctx_doc.view(1, C) == layout.anchor_doc.view(A, 1))
    ctx = ctx.unsqueeze(1).expand(A, B, C)  # [A, B, C]
    if window is not None:
        q_pos = layout.anchor_pos.view(A, 1, 1) + torch.arange(B, device=device).view(1, B, 1)
        ctx = ctx & ((q_pos - layout.ctx_pos.view(1, 1, C)) < window)
    inner = _within_block(B, within_block, window, device)  # [B, B]
    eye = torch.eye(A, dtype=torch.bool, device=device)  # [A, A]
    blocks = (eye.view(A, 1, A, 1) & inner.view(1, B, 1, B)).reshape(A * B, A * B)
    mask = torch.cat([ctx.reshape(A * B, C), blocks], dim=1)
    return mask.view(1, 1, A * B, C + A * B)


def _within_block(B: int, within_block: WithinBlock, window: int | None, device: torch.device) -> Tensor:
    i = torch.arange(B, device=device).view(B, 1)
    j = torch.arange(B, device=device).view(1, B)
    inner = torch.ones(B, B, dtype=torch.bool, device=device)
    if within_block == "causal":
        inner &= j <= i
    if window is not None:
        inner &= (i - j).abs() < window
    return inner


_compiled_create_block_mask: Any = None


def _create_block_mask_fn(on_cuda: bool) -> Any:
    """``create_block_mask``, compiled on CUDA so that it never materializes the [Q, KV] mask."""
    global _compiled_create_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    if not on_cuda:
        return create_block_mask
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask)
    return _compiled_create_block_mask


def _flex_mask(layout: BlockLayout, within_block: WithinBlock, window: int | None) -> Any:
    A, B, C = layout.num_blocks, layout.block_size, layout.context_len
    anchors, ctx_doc, ctx_pos = layout.anchors, layout.ctx_doc, layout.ctx_pos
    anchor_doc, anchor_pos = layout.anchor_doc, layout.anchor_pos
    causal = within_block == "causal"

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        n = q_idx // B
        i = q_idx % B
        is_ctx = kv_idx < C
        kc = kv_idx.clamp(max=C - 1)
        ctx_ok = is_ctx & (kv_idx < anchors[n]) & (ctx_doc[kc] == anchor_doc[n])
        if window is not None:
            ctx_ok = ctx_ok & ((anchor_pos[n] + i - ctx_pos[kc]) < window)
        kb = (kv_idx - C).clamp(min=0)
        j = kb % B
        blk_ok = (~is_ctx) & (kb // B == n)
        if causal:
            blk_ok = blk_ok & (j <= i)
        if window is not None:
            blk_ok = blk_ok & ((i - j).abs() < window)
        return ctx_ok | blk_ok

    make = _create_block_mask_fn(anchors.is_cuda)
    return make(mask_mod, B=None, H=None, Q_LEN=A * B, KV_LEN=C + A * B, device=str(anchors.device))


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
    q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, *, within_block: WithinBlock, window: int | None,
    backend: AttentionBackend, scale: float,
) -> Tensor:
    """q [1, Hq, A*B, D], k/v [1, Hkv, C + A*B, D] -> [1, Hq, A*B, D] under the layout's mask."""
    gqa = q.shape[1] != k.shape[1]
    if backend == "flex":
        block_mask = layout.flex(within_block, window)
        return _flex_fn()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    C, B = layout.context_len, layout.block_size
    outs = []
    for c0, c1, n0, n1, mask in layout.row_masks(within_block, window, q.dtype):  # a block sees its row only
        kr = torch.cat([k[:, :, c0:c1], k[:, :, C + n0 * B:C + n1 * B]], dim=2)  # [1, Hkv, T + Q_r, D]
        vr = torch.cat([v[:, :, c0:c1], v[:, :, C + n0 * B:C + n1 * B]], dim=2)
        outs.append(F.scaled_dot_product_attention(q[:, :, n0 * B:n1 * B], kr, vr, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

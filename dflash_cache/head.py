"""The teacher's frozen embedding and lm_head, stored once in the cache as safetensors."""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import CacheCorruptError, CacheError
from .spec import CacheSpec

HEAD_KEY = "head.safetensors"


def encode_head(spec: CacheSpec, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None) -> bytes:
    """Validate shapes ``[V, H]`` against the spec and serialise (``lm_head=None`` means tied)."""
    want = (spec.teacher.vocab_size, spec.teacher.hidden_size)
    tensors = {"embed_tokens": embed_tokens}
    if lm_head is not None:
        tensors["lm_head"] = lm_head
    for name, t in tensors.items():
        if tuple(t.shape) != want:
            raise CacheError(f"{name} must be [vocab_size, hidden_size] = {list(want)} as in the cache spec, "
                             f"got {list(t.shape)}")
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return st_save(tensors, metadata={"tied": str(lm_head is None).lower()})


def decode_head(raw: bytes, spec: CacheSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ``(embed_tokens [V, H], lm_head [V, H])``; lm_head is the embedding when tied. With ``spec``
    the shapes are checked against it."""
    try:
        tensors = st_load(raw)
    except (SafetensorError, ValueError) as err:
        raise CacheCorruptError(f"{HEAD_KEY} is not a readable safetensors file ({err}); re-run extraction "
                                "or cache.save_head", part=None, array=HEAD_KEY) from None
    if "embed_tokens" not in tensors:
        raise CacheCorruptError(f"{HEAD_KEY} lacks 'embed_tokens'", array=HEAD_KEY)
    embed = tensors["embed_tokens"]
    head = tensors.get("lm_head", embed)
    if spec is not None:
        want = [spec.teacher.vocab_size, spec.teacher.hidden_size]
        for name, t in (("embed_tokens", embed), ("lm_head", head)):
            if list(t.shape) != want:
                raise CacheCorruptError(f"{HEAD_KEY}: {name} is {list(t.shape)}, the cache spec says {want}",
                                        array=HEAD_KEY)
    return embed, head

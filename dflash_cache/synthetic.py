"""Synthetic caches with realistic activations, for tests and benchmarks (no teacher needed).

Trained LLMs have a few hidden channels whose magnitude is 100-1000x the typical one ("massive
activations"), and per-channel scales that vary; random-init models have neither, and compress
differently. :func:`synthetic_features` imitates the trained case.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .spec import CacheSpec, TeacherInfo
from .store import FeatureCache, create_cache


def synthetic_features(n_tokens: int, n_layers: int, hidden_size: int, generator: torch.Generator,
                       n_outliers: int | None = None) -> torch.Tensor:
    """bf16 ``[T, n_layers * hidden_size]``: typical |x| ~ 0.5, a few channels at 100-1000x that.

    The outlier channels are drawn from ``generator`` on each call; pass a generator seeded the same
    way to get the same channels across calls.
    """
    k = n_outliers if n_outliers is not None else max(2, hidden_size // 512)
    g = generator
    chan_scale = torch.exp(0.4 * torch.randn(n_layers, hidden_size, generator=g)) * 0.5  # [n, H]
    outlier_ch = torch.randperm(hidden_size, generator=g)[:k]  # same channels in every layer
    outlier_mag = 50 + 450 * torch.rand(n_layers, k, generator=g)  # [n, k]: 100-1000x of ~0.5
    x = torch.randn(n_tokens, n_layers, hidden_size, generator=g) * chan_scale  # [T, n, H]
    token_scale = torch.exp(0.3 * torch.randn(n_tokens, 1, 1, generator=g))  # [T, 1, 1]
    x = x * token_scale
    sign = torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)  # [k]
    jitter = 1 + 0.1 * torch.randn(n_tokens, n_layers, k, generator=g)  # [T, n, k]
    x[:, :, outlier_ch] = sign * outlier_mag * jitter
    return x.reshape(n_tokens, n_layers * hidden_size).to(torch.bfloat16)


def synthetic_lengths(n: int, rng: np.random.Generator, min_length: int, max_length: int,
                      median_length: int) -> np.ndarray:
    """Log-normal lengths (sigma 0.8) around ``median_length``, clipped to [min_length, max_length]."""
    raw = np.exp(np.log(median_length) + 0.8 * rng.standard_normal(n))
    return np.clip(np.round(raw), min_length, max_length).astype(np.int64)


def make_synthetic_cache(
    url: str,
    n_samples: int = 64,
    *,
    hidden_size: int = 64,
    num_layers: int = 8,
    target_layer_ids: Sequence[int] = (1, 3, 5),
    vocab_size: int = 512,
    lengths: Sequence[int] | None = None,
    min_length: int = 8,
    max_length: int = 512,
    median_length: int = 96,
    bucket_edges: Sequence[int] = (64, 128, 256),
    codec: str = "bf16-zstd",
    samples_per_part: int = 32,
    chunk_tokens: int = 64,
    shard_tokens: int = 1024,
    with_head: bool = True,
    with_argmax: bool = False,
    final_hidden: bool = False,
    first_id: int = 0,
    seed: int = 0,
) -> FeatureCache:
    """Create a cache at ``url`` filled with ``n_samples`` random samples, and return it opened.

    Deterministic in ``seed``. Sample ids are ``first_id .. first_id + n_samples - 1``. Lengths are
    ``lengths`` when given, else log-normal around ``median_length`` in [min_length, max_length].
    Each sample: ``input_ids`` uniform in [0, vocab_size), ``loss_mask`` off for the first ~30% of
    tokens (the "prompt") and on after, features from :func:`synthetic_features`, ``target_argmax``
    (when asked) the next input id; with ``final_hidden`` one more random slot stands for the teacher's final
    normed state. Samples are grouped by bucket into parts of ``samples_per_part``
    named ``syn<seed>-b<bucket>-p<k>``. With ``with_head`` a tied random embedding ``[V, H]`` is saved.
    Call it again with another ``first_id`` and ``seed`` to add parts to the same cache.
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = CacheSpec(
        teacher=TeacherInfo("synthetic", None, num_layers, hidden_size, vocab_size, "bfloat16"),
        target_layer_ids=list(target_layer_ids), tokenizer_hash="synthetic", max_length=max_length,
        codec=codec, bucket_edges=list(bucket_edges), dataset_fingerprint="synthetic", final_hidden=final_hidden,
    )
    cache = create_cache(url, spec, chunk_tokens=chunk_tokens, shard_tokens=shard_tokens)
    lens = (np.asarray(lengths, np.int64) if lengths is not None
            else synthetic_lengths(n_samples, rng, min_length, max_length, median_length))
    if len(lens) != n_samples:
        raise ValueError(f"lengths has {len(lens)} entries, n_samples is {n_samples}")
    by_bucket: dict[int, list[int]] = {}
    for i, t in enumerate(lens.tolist()):
        by_bucket.setdefault(cache.bucket_of(t), []).append(i)
    for b, members in sorted(by_bucket.items()):
        for k in range(0, len(members), samples_per_part):
            with cache.part_writer(b, f"syn{seed}-b{b}-p{k // samples_per_part:05d}", meta={"synthetic": True}) as w:
                for i in members[k:k + samples_per_part]:
                    _add_sample(w, first_id + i, int(lens[i]), spec, rng, gen, with_argmax)
    if with_head and not cache.has_head():
        cache.save_head(torch.randn(vocab_size, hidden_size, generator=gen).to(torch.bfloat16) * 0.02)
    return cache


def _add_sample(w, sample_id: int, t: int, spec: CacheSpec, rng: np.random.Generator, gen: torch.Generator,
                with_argmax: bool) -> None:
    ids = rng.integers(0, spec.teacher.vocab_size, size=t).astype(np.int64)  # [T]
    mask = np.arange(t) >= int(0.3 * t)  # [T]
    feats = synthetic_features(t, spec.feature_slots, spec.hidden_size, gen)  # [T, slots*H]
    argmax = np.concatenate([ids[1:], ids[:1]]) if with_argmax else None
    w.add(sample_id, ids, mask, feats, target_argmax=argmax)

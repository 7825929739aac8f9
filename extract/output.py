"""The cache an extraction writes: its spec (what decides its bytes), its creation by rank 0 with the
resolved config and the teacher head, and the work units read back from its commit records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from dflash_cache import CacheSpec, TeacherInfo, create_cache, open_cache
from dflash_cache.errors import CacheError
from dflash_cache.extraction import complete_units as extraction_complete_units
from dflash_cache.parts import PartInfo
from dflash_cache.protocols import CacheView, WritableCache
from dflash_cache.runtime.config import config_to_dict
from dflash_cache.runtime.dist import Distributed
from dflash_cache.runtime.schema import PipelineConfig
from dflash_cache.storage import storage_error

from .run_config import sample_rules, template_options
from .teacher import num_decoder_layers, resolve_mask_token, teacher_name
from .template import tokenizer_hash


def build_spec(cfg: PipelineConfig, model: Any, tokenizer: Any, layer_ids: list[int], dataset_fp: str) -> CacheSpec:
    text = model.config.get_text_config()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    teacher = TeacherInfo(
        name_or_path=teacher_name(cfg.teacher), revision=cfg.teacher.revision,
        num_layers=num_decoder_layers(model), hidden_size=int(text.hidden_size),
        vocab_size=vocab, dtype=cfg.teacher.dtype,
    )
    mask_id, mask_source = resolve_mask_token(cfg.mask_token_id, tokenizer, vocab)
    return CacheSpec(
        teacher=teacher, target_layer_ids=layer_ids, tokenizer_hash=tokenizer_hash(tokenizer, template_options(cfg)),
        max_length=cfg.data.max_length, codec=cfg.cache.codec, bucket_edges=cfg.cache.bucket_edges,
        dataset_fingerprint=dataset_fp, mask_token_id=mask_id, mask_token_source=mask_source,
        content_settings=content_settings(cfg),
        final_hidden=cfg.cache.store_final_hidden,
    )


def content_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The settings (beyond teacher, layers, codec, template and buckets, which have their own spec fields)
    that change the bytes a part holds, by dotted config name: sample rules decide which samples and
    tokens are kept, and work units and batch composition decide which samples share a padded teacher
    forward (whose numerics depend on it). Two jobs that differ here must not share a cache."""
    rules = sample_rules(cfg)
    x = cfg.extract
    return {
        "data.min_loss_tokens": rules.min_loss_tokens,
        "extract.unit_size": x.unit_size, "extract.tokens_per_batch": x.tokens_per_batch,
        "extract.max_batch_size": x.max_batch_size, "extract.batch_overhead": x.batch_overhead,
        "cache.store_target_argmax": cfg.cache.store_target_argmax,
        "teacher.attn_implementation": cfg.teacher.attn_implementation,
    }


def save_head(cache: WritableCache, model: Any) -> None:
    embed = model.get_input_embeddings().weight.detach().cpu()  # [V, H]
    head = model.get_output_embeddings().weight.detach().cpu()  # [V, H]
    tied = head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    cache.save_head(embed, None if tied else head)


@contextlib.contextmanager
def storage_errors(url: str, what: str) -> Iterator[None]:
    """OSErrors (disk full, permissions, a file in the way) as CacheErrors naming the path and what to do."""
    try:
        yield
    except OSError as err:
        raise storage_error(err, url, what) from err


def cache_exists(url: str) -> bool:
    try:
        open_cache(url)
    except CacheError:
        return False
    return True


def open_output(ctx: Distributed, url: str, spec: CacheSpec, cfg: PipelineConfig, model: Any,
                check: Any = None) -> WritableCache:
    """Rank 0 creates (or re-opens) the cache, writes metadata and the head. ``check()`` runs on every
    rank first when the cache does not exist yet (so bad data is refused before there is a cache)."""
    if check is not None and not cache_exists(url):
        check()
    ctx.barrier()
    cache = None
    if ctx.rank == 0:
        with storage_errors(url, "creating the cache"):
            cache = create_cache(url, spec, chunk_tokens=cfg.cache.chunk_tokens, shard_tokens=cfg.cache.shard_tokens)
            cache.write_metadata("config", config_to_dict(cfg))
        if not (cache.has_head() and cache.head_record() is not None):
            with storage_errors(url, "writing the teacher head (head.safetensors)"):
                save_head(cache, model)
    ctx.barrier()
    if cache is None:
        cache = open_cache(url)
        if cache.spec.fingerprint != spec.fingerprint:
            raise CacheError(f"{url}: the cache spec changed under this process; rerun all ranks together")
    return cache


def complete_units(cache: CacheView) -> set[int]:
    """Units whose every part is committed (the rule ``info``, ``verify`` and the trainer count by)."""
    return extraction_complete_units(cache.parts())


def check_units(cache: CacheView, units: Sequence[int], empty: set[int]) -> tuple[int, int, list[str]]:
    """Re-check ``units`` against the commit records: ``(complete units, their samples, problems)``.

    A unit is complete when every part its records name is committed and the parts hold the samples
    its records count (non-finite skips included); ``empty`` units kept no sample (nothing to write).
    """
    by_unit: dict[int, list[PartInfo]] = {}
    for p in cache.parts():
        if "unit" in p.meta:
            by_unit.setdefault(int(p.meta["unit"]), []).append(p)
    n_complete, n_samples, problems = 0, 0, []
    for u in units:
        if u in empty:
            n_complete += 1
            continue
        parts = by_unit.get(u, [])
        if not parts:
            problems.append(f"unit {u}: no committed part")
            continue
        meta = parts[0].meta
        held = sum(p.n_samples + int(p.meta.get("n_nonfinite", 0)) for p in parts)
        want = int(meta["unit_stats"]["n_samples"])
        if len(parts) != int(meta["unit_parts"]) or held != want:
            problems.append(f"unit {u}: {len(parts)} of {meta['unit_parts']} parts committed, {held} of {want} "
                            "samples")
            continue
        n_complete += 1
        n_samples += sum(p.n_samples for p in parts)
    return n_complete, n_samples, problems

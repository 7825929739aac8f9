"""The checks of one committed part's data against its commit record: what ``verify`` runs on every part
and what the recovery of a sealed generation (:mod:`dflash_cache.recover`) runs before committing it.

They need the storage, the part's record and its bucket's length bounds only (no opened cache), so the
lease and recovery modules can use them without importing the cache (:mod:`dflash_cache.store`).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from .codecs import crc32c, u16_to_bf16
from .errors import CacheCorruptError
from .parts import PartInfo
from .reader import ArrayReader, layouts_for
from .storage import Storage


class PartCheckError(Exception):
    """One check of a part failed: the array at fault and why."""

    def __init__(self, array: str, message: str):
        super().__init__(message)
        self.array, self.message = array, message


def _required(part: PartInfo) -> list[str]:
    names = ["features", "input_ids", "loss_mask", "offsets", "sample_ids"]
    return names + (["scales"] if part.codec == "fp8-e4m3" else [])


def _check_metadata(storage: Storage, part: PartInfo) -> None:
    groups = [part.key, part.data_key] if part.generation is not None else [part.key]
    for key in groups:  # zarr-python walks the hierarchy through these
        if not storage.exists(f"{key}/zarr.json"):
            raise PartCheckError("zarr.json", f"{key}/zarr.json (a zarr group document) is missing")
    for name in _required(part):
        if name not in part.arrays:
            raise PartCheckError(name, "the commit record does not list this array")
    for name, rec in part.arrays.items():
        try:
            meta = json.loads(storage.get(f"{part.data_key}/{name}/zarr.json"))
        except FileNotFoundError:
            raise PartCheckError(name, "zarr.json is missing") from None
        except ValueError:
            raise PartCheckError(name, "zarr.json is not valid JSON") from None
        if list(meta.get("shape", [])) != list(rec["shape"]) or meta.get("data_type") != rec["dtype"]:
            raise PartCheckError(name, f"zarr.json says shape {meta.get('shape')} {meta.get('data_type')}, the commit "
                             f"record says {rec['shape']} {rec['dtype']}")


def _check_counts(part: PartInfo, small: dict[str, np.ndarray], bounds: tuple[int, int]) -> None:
    a = part.arrays
    if a["features"]["shape"][0] != part.n_tokens:
        raise PartCheckError("features", f"{a['features']['shape'][0]} rows, commit record counts {part.n_tokens} tokens")
    for name in ("input_ids", "loss_mask", "target_argmax"):
        if name in a and a[name]["shape"][0] != part.n_tokens:
            raise PartCheckError(name, f"{a[name]['shape'][0]} tokens, commit record counts {part.n_tokens}")
    if a["sample_ids"]["shape"][0] != part.n_samples or a["offsets"]["shape"][0] != part.n_samples + 1:
        raise PartCheckError("sample_ids", f"{a['sample_ids']['shape'][0]} ids and {a['offsets']['shape'][0]} offsets, "
                         f"commit record counts {part.n_samples} samples")
    off = small["offsets"]
    if off[0] != 0 or off[-1] != part.n_tokens or np.any(np.diff(off) <= 0):
        raise PartCheckError("offsets", f"offsets must rise from 0 to {part.n_tokens}; got {off[:3].tolist()}..{off[-1]}")
    lengths = np.diff(off)
    lo, hi = bounds
    if lengths.size and (lengths.min() <= lo or lengths.max() > hi):
        raise PartCheckError("offsets", f"sample lengths {lengths.min()}..{lengths.max()} outside bucket ({lo}, {hi}]")
    if len(np.unique(small["sample_ids"])) != part.n_samples:
        raise PartCheckError("sample_ids", "sample ids repeat within the part")


def _check_features(storage: Storage, part: PartInfo) -> None:
    lay = layouts_for(part)
    readers = {n: ArrayReader(storage, lay[n], part.key) for n in ("features", "scales") if n in lay}
    crcs = dict.fromkeys(readers, 0)
    for name, r in readers.items():  # each shard's own index too (readers take it from the record's chunk table)
        tables = r.layout.chunk_tables
        if tables is None:
            continue
        n_shards = -(-part.n_tokens // part.shard_tokens)
        if len(tables) != n_shards:
            raise PartCheckError(name, f"the commit record holds {len(tables)} chunk tables for {n_shards} shards")
        for shard in range(n_shards):
            r.stored_shard_index(shard)  # checked against the index checksum the record binds, as the table is
    step = part.shard_tokens
    for start in range(0, part.n_tokens, step):
        stop = min(part.n_tokens, start + step)
        for name, r in readers.items():
            block = r.read(start, stop)
            crcs[name] = crc32c(block, crcs[name])
            if not _finite(name, block, part.codec):
                raise PartCheckError(name, f"non-finite values in tokens [{start}, {stop})")
    for name, value in crcs.items():
        if value != part.arrays[name]["crc32c"]:
            raise PartCheckError(name, "crc32c of the data differs from the commit record")


def _finite(name: str, block: np.ndarray, codec: str) -> bool:
    if name == "scales":
        return bool(np.isfinite(block).all())
    if codec == "fp8-e4m3":
        return not bool(((block & 0x7F) == 0x7F).any())  # e4m3fn NaN patterns
    return bool(torch.isfinite(u16_to_bf16(block)).all())


def check_part_arrays(storage: Storage, part: PartInfo, bounds: tuple[int, int]) -> dict[str, np.ndarray]:
    """Every check of ``verify`` on one part's data against its record (taken as given), ``bounds`` the
    sample lengths of its bucket; returns its small arrays. Raises :class:`PartCheckError` (or
    :class:`CacheCorruptError` from a read)."""
    _check_metadata(storage, part)
    lay = layouts_for(part)
    small = {}
    for name in ("input_ids", "loss_mask", "target_argmax", "offsets", "sample_ids"):
        if name in lay:
            reader = ArrayReader(storage, lay[name], part.key)
            small[name] = reader.read(0, lay[name].shape[0])
            if crc32c(small[name]) != part.arrays[name]["crc32c"]:
                raise PartCheckError(name, "crc32c of the data differs from the commit record")
            if lay[name].inline is not None and not np.array_equal(reader.read_all(), small[name]):
                raise PartCheckError(name, "the commit record's copy differs from the stored array")
    _check_counts(part, small, bounds)
    _check_features(storage, part)
    return small




def check_part(storage: Storage, part: PartInfo, bounds: tuple[int, int]) -> str | None:
    """Every check of ``verify`` on one part (its record taken as given): None when it passes, else why not."""
    try:
        check_part_arrays(storage, part, bounds)
    except PartCheckError as err:
        return f"array {err.array}: {err.message}"
    except CacheCorruptError as err:
        return str(err)
    return None

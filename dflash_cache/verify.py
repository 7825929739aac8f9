"""``verify``: re-read every committed part and check it against its commit record."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .codecs import crc32c, u16_to_bf16
from .errors import CacheCorruptError
from .parts import PartInfo
from .reader import ArrayReader, layouts_for
from .storage import Storage
from .store import FeatureCache, open_cache

log = logging.getLogger(__name__)


@dataclass
class Problem:
    part: str
    array: str
    message: str

    def __str__(self) -> str:
        return f"part {self.part}, array {self.array}: {self.message}"


@dataclass
class VerifyReport:
    n_parts: int = 0
    n_samples: int = 0
    n_tokens: int = 0
    problems: list[Problem] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        s = f"{self.n_parts} parts, {self.n_samples} samples, {self.n_tokens} tokens: "
        s += "all checks pass" if self.ok else f"{len(self.problems)} problem(s)"
        if self.uncommitted:
            s += f"; {len(self.uncommitted)} uncommitted leftover(s) (dflash-cache gc removes them)"
        return s


class _PartCheck(Exception):
    def __init__(self, array: str, message: str):
        super().__init__(message)
        self.array, self.message = array, message


def _required(part: PartInfo) -> list[str]:
    names = ["features", "input_ids", "loss_mask", "offsets", "sample_ids"]
    return names + (["scales"] if part.codec == "fp8-e4m3" else [])


def _check_metadata(storage: Storage, part: PartInfo) -> None:
    for name in _required(part):
        if name not in part.arrays:
            raise _PartCheck(name, "the commit record does not list this array")
    for name, rec in part.arrays.items():
        try:
            meta = json.loads(storage.get(f"{part.key}/{name}/zarr.json"))
        except FileNotFoundError:
            raise _PartCheck(name, "zarr.json is missing") from None
        except ValueError:
            raise _PartCheck(name, "zarr.json is not valid JSON") from None
        if list(meta.get("shape", [])) != list(rec["shape"]) or meta.get("data_type") != rec["dtype"]:
            raise _PartCheck(name, f"zarr.json says shape {meta.get('shape')} {meta.get('data_type')}, the commit "
                             f"record says {rec['shape']} {rec['dtype']}")


def _check_counts(part: PartInfo, small: dict[str, np.ndarray], bounds: tuple[int, int]) -> None:
    a = part.arrays
    if a["features"]["shape"][0] != part.n_tokens:
        raise _PartCheck("features", f"{a['features']['shape'][0]} rows, commit record counts {part.n_tokens} tokens")
    for name in ("input_ids", "loss_mask", "target_argmax"):
        if name in a and a[name]["shape"][0] != part.n_tokens:
            raise _PartCheck(name, f"{a[name]['shape'][0]} tokens, commit record counts {part.n_tokens}")
    if a["sample_ids"]["shape"][0] != part.n_samples or a["offsets"]["shape"][0] != part.n_samples + 1:
        raise _PartCheck("sample_ids", f"{a['sample_ids']['shape'][0]} ids and {a['offsets']['shape'][0]} offsets, "
                         f"commit record counts {part.n_samples} samples")
    off = small["offsets"]
    if off[0] != 0 or off[-1] != part.n_tokens or np.any(np.diff(off) <= 0):
        raise _PartCheck("offsets", f"offsets must rise from 0 to {part.n_tokens}; got {off[:3].tolist()}..{off[-1]}")
    lengths = np.diff(off)
    lo, hi = bounds
    if lengths.size and (lengths.min() <= lo or lengths.max() > hi):
        raise _PartCheck("offsets", f"sample lengths {lengths.min()}..{lengths.max()} outside bucket ({lo}, {hi}]")
    if len(np.unique(small["sample_ids"])) != part.n_samples:
        raise _PartCheck("sample_ids", "sample ids repeat within the part")


def _check_features(storage: Storage, part: PartInfo) -> None:
    lay = layouts_for(part)
    readers = {n: ArrayReader(storage, lay[n], part.key) for n in ("features", "scales") if n in lay}
    crcs = dict.fromkeys(readers, 0)
    step = part.shard_tokens
    for start in range(0, part.n_tokens, step):
        stop = min(part.n_tokens, start + step)
        for name, r in readers.items():
            block = r.read(start, stop)
            crcs[name] = crc32c(block, crcs[name])
            if not _finite(name, block, part.codec):
                raise _PartCheck(name, f"non-finite values in tokens [{start}, {stop})")
    for name, value in crcs.items():
        if value != part.arrays[name]["crc32c"]:
            raise _PartCheck(name, "crc32c of the data differs from the commit record")


def _finite(name: str, block: np.ndarray, codec: str) -> bool:
    if name == "scales":
        return bool(np.isfinite(block).all())
    if codec == "fp8-e4m3":
        return not bool(((block & 0x7F) == 0x7F).any())  # e4m3fn NaN patterns
    return bool(torch.isfinite(u16_to_bf16(block)).all())


def _check_part(storage: Storage, cache: FeatureCache, part: PartInfo) -> dict[str, np.ndarray]:
    _check_metadata(storage, part)
    lay = layouts_for(part)
    small = {}
    for name in ("input_ids", "loss_mask", "target_argmax", "offsets", "sample_ids"):
        if name in lay:
            small[name] = ArrayReader(storage, lay[name], part.key).read(0, lay[name].shape[0])
            if crc32c(small[name]) != part.arrays[name]["crc32c"]:
                raise _PartCheck(name, "crc32c of the data differs from the commit record")
    _check_counts(part, small, cache.bucket_bounds(part.bucket))
    _check_features(storage, part)
    return small


def verify_cache(url: str, storage: Storage | None = None, raise_on_error: bool = True) -> VerifyReport:
    """Check every committed part; raises :class:`CacheCorruptError` naming the first part and array at
    fault (the message lists every problem) unless ``raise_on_error`` is False."""
    cache = open_cache(url, storage=storage)
    report = VerifyReport(uncommitted=cache.uncommitted())
    seen: dict[int, str] = {}
    for part in cache.parts():
        report.n_parts += 1
        try:
            small = _check_part(cache.storage, cache, part)
        except _PartCheck as err:
            report.problems.append(Problem(part.key, err.array, err.message))
            continue
        except CacheCorruptError as err:
            report.problems.append(Problem(part.key, err.array or "?", str(err)))
            continue
        report.n_samples += part.n_samples
        report.n_tokens += part.n_tokens
        _check_duplicates(report, seen, small["sample_ids"], part.key)
    if report.problems and raise_on_error:
        first = report.problems[0]
        listing = "\n  ".join(str(p) for p in report.problems[:20])
        raise CacheCorruptError(f"{url}: verify found {len(report.problems)} problem(s):\n  {listing}\n"
                                "Re-extract the parts named (delete their directories first).",
                                part=first.part, array=first.array)
    return report


def _check_duplicates(report: VerifyReport, seen: dict[int, str], ids: Any, key: str) -> None:
    for sid in ids.tolist():
        other = seen.setdefault(int(sid), key)
        if other != key:
            report.problems.append(Problem(key, "sample_ids", f"sample id {sid} is also in part {other}"))
            return

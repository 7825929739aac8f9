"""The cache index: one row per sample, built from the small arrays (offsets, sample ids) only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .errors import CacheCorruptError, SampleNotFoundError
from .parts import PartInfo
from .reader import ArrayReader, layouts_for
from .storage import Storage


@dataclass
class CacheIndex:
    """``sample_ids`` int64[N], ``lengths`` int32[N], ``buckets`` int16[N], ``part`` int32[N] (into
    ``parts``), ``row`` int32[N] (position in the part), ``token_start`` int64[N] (offset in the part)."""

    sample_ids: np.ndarray
    lengths: np.ndarray
    buckets: np.ndarray
    part: np.ndarray
    row: np.ndarray
    token_start: np.ndarray
    parts: list[PartInfo]
    skipped: list[CacheCorruptError] = field(default_factory=list)  # parts left out (``skip_corrupt``)
    _order: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.sample_ids.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def positions(self, sample_ids: np.ndarray | list[int]) -> np.ndarray:
        """Index rows of ``sample_ids`` (SampleNotFoundError naming unknown ids)."""
        if self._order is None:
            self._order = np.argsort(self.sample_ids, kind="stable")
        ids = np.asarray(sample_ids, dtype=np.int64)
        sorted_ids = self.sample_ids[self._order]
        pos = np.searchsorted(sorted_ids, ids)
        pos = np.minimum(pos, max(len(self) - 1, 0))
        found = (len(self) > 0) & (sorted_ids[pos] == ids) if len(self) else np.zeros(ids.shape, bool)
        if not np.all(found):
            missing = ids[~found][:5].tolist()
            raise SampleNotFoundError(f"sample ids {missing} are not in any committed part of the cache "
                                      "(never written, or their part has no commit record)")
        return self._order[pos]


def _part_arrays(storage: Storage, part: PartInfo) -> tuple[np.ndarray, np.ndarray]:
    lay = layouts_for(part)
    ids = ArrayReader(storage, lay["sample_ids"], part.key).read_all()
    offsets = ArrayReader(storage, lay["offsets"], part.key).read_all()
    if offsets[0] != 0 or offsets[-1] != part.n_tokens or np.any(np.diff(offsets) <= 0):
        raise CacheCorruptError(f"part {part.key}: offsets do not run from 0 to n_tokens={part.n_tokens} in "
                                "increasing steps; run `dflash-cache verify`", part=part.key, array="offsets")
    return ids.astype(np.int64), offsets.astype(np.int64)


def build_index(storage: Storage, parts: list[PartInfo], threads: int = 8, skip_corrupt: bool = False) -> CacheIndex:
    """Read ``sample_ids`` and ``offsets`` of every part (never a feature chunk). With ``skip_corrupt``
    a part whose small arrays cannot be read is left out (listed in ``skipped``) instead of raising."""

    def read(p: PartInfo) -> tuple[np.ndarray, np.ndarray] | CacheCorruptError:
        try:
            return _part_arrays(storage, p)
        except CacheCorruptError as err:
            if not skip_corrupt:
                raise
            return err

    with ThreadPoolExecutor(max_workers=threads) as pool:
        got = list(pool.map(read, parts))
    skipped = [a for a in got if isinstance(a, CacheCorruptError)]
    parts = [p for p, a in zip(parts, got, strict=True) if not isinstance(a, CacheCorruptError)]
    arrays = [a for a in got if not isinstance(a, CacheCorruptError)]
    n = [p.n_samples for p in parts]
    if not parts:
        e = np.zeros(0, np.int64)
        return CacheIndex(e, e.astype(np.int32), e.astype(np.int16), e.astype(np.int32), e.astype(np.int32), e, [],
                          skipped)
    ids = np.concatenate([a[0] for a in arrays])
    offsets = [a[1] for a in arrays]
    idx = CacheIndex(
        sample_ids=ids,
        lengths=np.concatenate([np.diff(o) for o in offsets]).astype(np.int32),
        buckets=np.repeat(np.array([p.bucket for p in parts], np.int16), n),
        part=np.repeat(np.arange(len(parts), dtype=np.int32), n),
        row=np.concatenate([np.arange(k, dtype=np.int32) for k in n]),
        token_start=np.concatenate([o[:-1] for o in offsets]),
        parts=parts,
        skipped=skipped,
    )
    _check_unique(idx)
    return idx


def _check_unique(idx: CacheIndex) -> None:
    order = np.argsort(idx.sample_ids, kind="stable")
    s = idx.sample_ids[order]
    dup = np.nonzero(s[1:] == s[:-1])[0]
    if dup.size:
        i, j = order[dup[0]], order[dup[0] + 1]
        a, b = idx.parts[idx.part[i]].key, idx.parts[idx.part[j]].key
        raise CacheCorruptError(
            f"sample id {int(s[dup[0]])} appears in two places ({a} and {b}); {dup.size} duplicate(s) in all. "
            "A work unit was written twice: remove one of the parts (delete its directory) and re-run verify",
            part=b, array="sample_ids")
    idx._order = order

"""Length buckets: bucket ``b`` holds lengths in ``(edges[b-1], edges[b]]``; the last one up to max_length."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .errors import DataError


def bucket_of(edges: Sequence[int], max_length: int, length: int) -> int:
    """The bucket a sample of ``length`` tokens is routed to."""
    if length <= 0:
        raise DataError(f"a sample must have at least one token, got length {length}")
    if length > max(max_length, edges[-1] if edges else 0):
        raise DataError(f"sample length {length} exceeds the cache's max_length {max_length}; "
                        "truncate or filter it before writing")
    return bisect.bisect_left(list(edges), length)


def bucket_bounds(edges: Sequence[int], max_length: int, b: int) -> tuple[int, int]:
    """``(lo, hi)``: bucket ``b`` holds lengths ``lo < T <= hi``."""
    if not 0 <= b <= len(edges):
        raise IndexError(f"bucket {b} does not exist: the cache has buckets 0..{len(edges)}")
    lo = 0 if b == 0 else edges[b - 1]
    hi = edges[b] if b < len(edges) else max(max_length, lo)
    return lo, hi

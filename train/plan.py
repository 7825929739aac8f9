"""The training plan: which samples form which batch, in which order, on which rank.

A plan is a pure function of (seed, epoch, window, the index arrays, world size, rank, token
budget, packing). It never reads a feature; for 100k samples it takes well under a second.

How an epoch is built:

1. Held-out samples (``holdout_mask``) are removed; the rest is put in a canonical order
   (by sample id), so the plan does not depend on the order in which parts are listed.
2. Per bucket, samples are shuffled, cut into *sort windows* of ``sort_window`` batches' worth
   of tokens, and each window is sorted by length before it is cut into batches. Samples
   of similar length share a batch (little padding) while the company a sample keeps
   still changes from epoch to epoch.
   - padded rows: one sample per row, rows padded to the longest sample of the batch,
     ``rows * longest <= tokens_per_batch``;
   - packed rows (``packing``): samples are packed back to back into rows of at most
     ``row_tokens`` tokens (longest-first onto the emptiest row), ``tokens_per_batch //
     row_tokens`` rows per batch (rows of similar fill together), padded to the fullest row.
3. The batch order within each bucket is shuffled, and buckets are interleaved by a stride:
   batch i of a bucket with n batches sits at (i + u_b) / n for a random offset u_b, so every
   bucket is spread evenly over the whole epoch, in proportion to its token count.
4. Ranks take batches round-robin. When the batch count is not a multiple of the world
   size, the batches with the most samples are split in two (never a sample dropped or
   repeated) until it is; ``PlanStats.n_split`` counts these splits.

Edge cases: an empty bucket simply contributes no batch; a sample longer than the token
budget (or than ``row_tokens``) is a ``ConfigError`` (raise the budget), never truncated or
silently dropped; fewer training samples than ranks is a ``DataError``.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

import numpy as np

from dflash_cache.errors import ConfigError, DataError

PLAN_VERSION = 1
_MASK64 = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser (a stable 64-bit hash) of int64/uint64 values."""
    x = np.asarray(values).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stable_hash(*values: int) -> int:
    """A 63-bit hash of a tuple of integers, the same in every process and Python version."""
    h = 0
    for v in values:
        h = _splitmix64_int(h ^ _splitmix64_int(int(v) & _MASK64))
    return h >> 1


def holdout_mask(sample_ids: np.ndarray, fraction: float) -> np.ndarray:
    """True for the samples kept out of training (for evaluation): those whose id hash, as a
    fraction of 2**64, falls below ``fraction``. Stable across processes and runs."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"holdout fraction must be in [0, 1), got {fraction}")
    threshold = np.uint64(min(int(fraction * 2.0**64), _MASK64))
    return splitmix64(sample_ids) < threshold


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the plan. ``positions`` index the arrays the plan was built from."""

    bucket: int
    positions: np.ndarray  # int64 [S], row-major (row 0's samples first)
    row_splits: np.ndarray  # int64 [R+1]: row r holds positions[row_splits[r]:row_splits[r+1]]
    seq_len: int  # T: tokens per row after padding
    n_tokens: int  # real tokens
    index: int = -1  # batch index within the epoch on this rank
    seed: int = 0  # stable_hash(seed, epoch, index, rank)

    @property
    def num_rows(self) -> int:
        return len(self.row_splits) - 1

    @property
    def n_padded(self) -> int:
        return self.num_rows * self.seq_len - self.n_tokens

    def rows(self) -> list[np.ndarray]:
        return [self.positions[a:b] for a, b in zip(self.row_splits[:-1], self.row_splits[1:], strict=True)]


@dataclass
class PlanStats:
    n_samples: int = 0  # training samples in the whole plan (all ranks)
    n_holdout: int = 0  # samples held out for evaluation
    n_tokens: int = 0
    n_padded: int = 0  # padding slots over all batches of all ranks
    n_batches: int = 0  # batches over all ranks
    n_split: int = 0  # batches split in two to give every rank the same count
    batches_per_bucket: dict[int, int] = field(default_factory=dict)

    @property
    def padding_fraction(self) -> float:
        total = self.n_tokens + self.n_padded
        return self.n_padded / total if total else 0.0


@dataclass(frozen=True)
class PlanSettings:
    seed: int
    world_size: int = 1
    tokens_per_batch: int = 16384
    packing: bool = False
    row_tokens: int | None = None  # packed row length; None: tokens_per_batch (one row per batch)
    sort_window: int = 64  # batches' worth of tokens sorted by length together
    holdout_fraction: float = 0.0

    def pack_row_tokens(self) -> int:
        return self.row_tokens or self.tokens_per_batch


@dataclass
class EpochPlan:
    """This rank's batches for one epoch (or one live window of it)."""

    epoch: int
    window: int
    rank: int
    batches: list[PlannedBatch]
    stats: PlanStats
    identity: str  # hash of everything the plan depends on (checked on resume)

    def __len__(self) -> int:
        return len(self.batches)


def build_plan(
    sample_ids: np.ndarray,
    lengths: np.ndarray,
    buckets: np.ndarray,
    settings: PlanSettings,
    *,
    epoch: int,
    rank: int = 0,
    window: int = 0,
    first_index: int = 0,
) -> EpochPlan:
    """This rank's batches for ``epoch`` (``window`` numbers live-mode windows within it).

    ``first_index`` is the batch index the first batch of this plan gets (live windows
    continue the numbering of the epoch)."""
    _check_settings(settings, rank)
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.asarray(buckets, dtype=np.int64)
    stats = PlanStats()
    positions = _training_positions(sample_ids, lengths, settings, stats)
    _check_lengths(lengths[positions], settings)
    rng_key = (settings.seed, epoch, window)
    per_bucket = {}
    for b in np.unique(buckets[positions]).tolist():
        pos_b = positions[buckets[positions] == b]
        per_bucket[b] = _bucket_batches(pos_b, lengths, b, settings, np.random.default_rng([*rng_key, b]))
    ordered = _interleave(per_bucket, np.random.default_rng([*rng_key, 1 << 20]))
    ordered, stats.n_split = _balance(ordered, lengths, settings.world_size)
    mine = _assign(ordered, settings, epoch, rank, first_index)
    _fill_stats(stats, ordered)
    identity = _identity(sample_ids[positions], lengths[positions], buckets[positions], settings, epoch, window, rank)
    return EpochPlan(epoch=epoch, window=window, rank=rank, batches=mine, stats=stats, identity=identity)


def _check_settings(s: PlanSettings, rank: int) -> None:
    if s.world_size < 1 or not 0 <= rank < s.world_size:
        raise ConfigError(f"rank must be in [0, world_size={s.world_size}), got {rank}")
    if s.tokens_per_batch < 1 or s.sort_window < 1:
        raise ConfigError("loader.tokens_per_batch and loader.sort_window must be positive")
    if s.packing and s.pack_row_tokens() > s.tokens_per_batch:
        raise ConfigError(
            f"loader.pack_row_tokens={s.row_tokens} exceeds loader.tokens_per_batch={s.tokens_per_batch}; "
            "a batch must hold at least one packed row"
        )


def _training_positions(ids: np.ndarray, lengths: np.ndarray, s: PlanSettings, stats: PlanStats) -> np.ndarray:
    if len(ids) != len(lengths):
        raise DataError(f"index arrays disagree: {len(ids)} sample ids but {len(lengths)} lengths")
    order = np.argsort(ids, kind="stable")
    if len(ids) > 1 and np.any(ids[order][1:] == ids[order][:-1]):
        dup = ids[order][1:][ids[order][1:] == ids[order][:-1]][:5].tolist()
        raise DataError(f"the cache index holds duplicate sample ids (e.g. {dup}); run `dflash-cache verify`")
    held = holdout_mask(ids[order], s.holdout_fraction) if s.holdout_fraction > 0 else np.zeros(len(ids), bool)
    positions = order[~held]
    stats.n_holdout = int(held.sum())
    stats.n_samples = len(positions)
    if stats.n_samples < s.world_size:
        raise DataError(
            f"{stats.n_samples} training samples ({len(ids)} in the index, {stats.n_holdout} held out) "
            f"cannot give each of {s.world_size} ranks a batch; extract more data or lower "
            "loader.holdout_fraction"
        )
    return positions


def _check_lengths(lengths: np.ndarray, s: PlanSettings) -> None:
    if lengths.size and lengths.min() < 1:
        raise DataError("the cache index holds a sample of length 0; run `dflash-cache verify`")
    limit = s.pack_row_tokens() if s.packing else s.tokens_per_batch
    if lengths.size and lengths.max() > limit:
        key = "loader.pack_row_tokens" if s.packing and s.row_tokens else "loader.tokens_per_batch"
        raise ConfigError(
            f"the longest training sample has {int(lengths.max())} tokens but {key}={limit}; "
            f"set {key} >= {int(lengths.max())} (samples are never truncated)"
        )


def _sort_windows(pos: np.ndarray, lengths: np.ndarray, s: PlanSettings, rng: np.random.Generator):
    """Shuffle, then cut into windows of ``sort_window`` batches' worth of tokens."""
    pos = pos[rng.permutation(len(pos))]
    cum = np.cumsum(lengths[pos])
    cut = np.searchsorted(cum, np.arange(1, int(cum[-1] // (s.sort_window * s.tokens_per_batch)) + 1)
                          * s.sort_window * s.tokens_per_batch, side="right")
    return [w for w in np.split(pos, cut) if len(w)]


def _bucket_batches(pos: np.ndarray, lengths: np.ndarray, bucket: int, s: PlanSettings,
                    rng: np.random.Generator) -> list[PlannedBatch]:
    batches: list[PlannedBatch] = []
    for win in _sort_windows(pos, lengths, s, rng):
        if s.packing:
            batches.extend(_packed_batches(win, lengths, bucket, s))
        else:
            batches.extend(_padded_batches(win, lengths, bucket, s.tokens_per_batch))
    return [batches[i] for i in rng.permutation(len(batches))]


def _padded_batches(win: np.ndarray, lengths: np.ndarray, bucket: int, budget: int) -> list[PlannedBatch]:
    win = win[np.argsort(lengths[win], kind="stable")]  # ascending: the newest sample is the longest
    lens = lengths[win].tolist()
    out, start = [], 0
    for j, n in enumerate(lens):
        if (j - start + 1) * n > budget:
            out.append(_padded(win[start:j], lengths, bucket))
            start = j
    out.append(_padded(win[start:], lengths, bucket))
    return out


def _padded(pos: np.ndarray, lengths: np.ndarray, bucket: int) -> PlannedBatch:
    lens = lengths[pos]
    return PlannedBatch(bucket=bucket, positions=pos, row_splits=np.arange(len(pos) + 1, dtype=np.int64),
                        seq_len=int(lens.max()), n_tokens=int(lens.sum()))


def _pack_rows(win: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Longest first onto the emptiest row (rows pre-opened for the window's token total)."""
    order = win[np.argsort(-lengths[win], kind="stable")]
    n_rows = max(1, -(-int(lengths[win].sum()) // capacity))
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    heap = [(0, r) for r in range(n_rows)]  # (fill, row id): the emptiest row on top
    for p, n in zip(order.tolist(), lengths[order].tolist(), strict=True):
        fill, r = heap[0]
        if fill + n > capacity:
            rows.append([])
            r, fill = len(rows) - 1, 0
            heapq.heappush(heap, (fill + n, r))
        else:
            heapq.heapreplace(heap, (fill + n, r))
        rows[r].append(p)
    return [r for r in rows if r]


def _packed_batches(win: np.ndarray, lengths: np.ndarray, bucket: int, s: PlanSettings) -> list[PlannedBatch]:
    rows = [np.asarray(r, dtype=np.int64) for r in _pack_rows(win, lengths, s.pack_row_tokens())]
    rows.sort(key=lambda r: int(lengths[r].sum()))  # rows of similar fill share a batch (padding)
    per = max(1, s.tokens_per_batch // s.pack_row_tokens())
    return [_packed(rows[i:i + per], lengths, bucket) for i in range(0, len(rows), per)]


def _packed(rows: list[np.ndarray], lengths: np.ndarray, bucket: int) -> PlannedBatch:
    fills = [int(lengths[r].sum()) for r in rows]
    splits = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    return PlannedBatch(bucket=bucket, positions=np.concatenate(rows), row_splits=splits,
                        seq_len=max(fills), n_tokens=sum(fills))


def _interleave(per_bucket: dict[int, list[PlannedBatch]], rng: np.random.Generator) -> list[PlannedBatch]:
    """Spread each bucket's batches evenly over the epoch: batch i of n at (i + u_b) / n."""
    keyed = []
    for b, batches in sorted(per_bucket.items()):
        u = rng.random()
        n = len(batches)
        keyed.extend(((i + u) / n, b, i, batch) for i, batch in enumerate(batches))
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


def _split(batch: PlannedBatch, lengths: np.ndarray) -> tuple[PlannedBatch, PlannedBatch]:
    if batch.num_rows >= 2:
        rows = batch.rows()
        half = len(rows) // 2
        groups = [rows[:half], rows[half:]]
    else:
        row = batch.positions
        groups = [[row[: len(row) // 2]], [row[len(row) // 2:]]]
    return _packed(groups[0], lengths, batch.bucket), _packed(groups[1], lengths, batch.bucket)


def _balance(batches: list[PlannedBatch], lengths: np.ndarray, world: int) -> tuple[list[PlannedBatch], int]:
    """Split the batches with the most samples until every rank gets the same count."""
    n_split = 0
    while len(batches) % world:
        sizes = [len(b.positions) for b in batches]
        i = len(sizes) - 1 - int(np.argmax(sizes[::-1]))  # the latest of the largest
        if sizes[i] < 2:
            raise DataError(f"cannot give {world} ranks the same number of batches: too few samples")
        batches[i:i + 1] = list(_split(batches[i], lengths))
        n_split += 1
    return batches, n_split


def _assign(batches: list[PlannedBatch], s: PlanSettings, epoch: int, rank: int, first: int) -> list[PlannedBatch]:
    mine = batches[rank::s.world_size]
    out = []
    for k, b in enumerate(mine):
        idx = first + k
        out.append(PlannedBatch(bucket=b.bucket, positions=b.positions, row_splits=b.row_splits,
                                seq_len=b.seq_len, n_tokens=b.n_tokens, index=idx,
                                seed=stable_hash(s.seed, epoch, idx, rank)))
    return out


def _fill_stats(stats: PlanStats, batches: list[PlannedBatch]) -> None:
    stats.n_batches = len(batches)
    for b in batches:
        stats.n_tokens += b.n_tokens
        stats.n_padded += b.n_padded
        stats.batches_per_bucket[b.bucket] = stats.batches_per_bucket.get(b.bucket, 0) + 1


def _identity(ids: np.ndarray, lengths: np.ndarray, buckets: np.ndarray, s: PlanSettings,
              epoch: int, window: int, rank: int) -> str:
    h = hashlib.sha256()
    h.update(repr((PLAN_VERSION, s, epoch, window, rank)).encode())
    for a in (ids, lengths, buckets):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]

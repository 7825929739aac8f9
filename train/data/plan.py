"""The training plan: which samples form which batch, in which order, on which rank.

A plan is a pure function of (seed, epoch, window, the index arrays, world size, rank, token
budget, block-position budget, packing). It never reads a feature. It is built with array
operations (a handful of numpy passes per bucket, one Python step per batch), costs O(samples),
and is stored columnar (numpy arrays, not one object per batch): 1M samples plan in well under a
second and take ~10 bytes per sample.

How an epoch is built:

1. Held-out samples (``holdout_mask``) are removed; the rest is put in a canonical order
   (by sample id), so the plan does not depend on the order in which parts are listed.
   :class:`Planner` does this once for every epoch planned over the same arrays.
2. Per bucket, samples are shuffled, cut into *sort windows* of ``sort_window`` batches' worth
   of tokens, and each window is sorted by length before it is cut into batches. Samples
   of similar length share a batch (little padding) while the company a sample keeps
   still changes from epoch to epoch. A batch closes before a sample that would break either budget:
   - tokens: padded rows (one sample per row) hold ``rows * longest <= tokens_per_batch``; packed rows
     (``packing``: samples back to back in rows of at most ``row_tokens`` tokens, longest-first onto
     the emptiest row) are grouped ``tokens_per_batch // row_tokens`` rows per batch at most, rows of
     similar fill together, padded to the fullest row;
   - block positions (``max_block_positions``): a document of length L anchors at most
     ``min(num_anchors, L - 1)`` blocks of ``block_size`` positions (an upper bound of its eligible
     anchors, known from lengths alone); their sum over the batch's documents stays within the budget,
     so the drafter's memory per step is bounded whatever the lengths. Batches of short documents
     hold fewer documents; a packed row never holds more than the budget either.
3. The batch order within each bucket is shuffled, and buckets are interleaved by a stride:
   batch i of a bucket with n batches sits at (i + u_b) / n for a random offset u_b, so every
   bucket is spread evenly over the whole epoch, in proportion to its token count.
4. Ranks take batches round-robin. When the batch count is not a multiple of the world
   size, the batches with the most samples are split in two (never a sample dropped or
   repeated) until it is; ``PlanStats.n_split`` counts these splits.

Every sample is in exactly one batch of exactly one rank per epoch, every rank gets the same
number of batches, and ``EpochPlan.identity`` hashes everything the plan depends on (a resumed
run checks it). Edge cases: an empty bucket simply contributes no batch; a sample longer than the
token budget (or than ``row_tokens``), or whose block positions alone exceed the block budget, is a
``ConfigError`` (raise the budget), never truncated or silently dropped; fewer training samples than
ranks is a ``DataError``.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_cache.errors import ConfigError, DataError

if TYPE_CHECKING:
    from train.config import LoaderConfig

PLAN_VERSION = 2
_MASK64 = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser (a stable 64-bit hash) of int64/uint64 values."""
    x = np.asarray(values).astype(np.uint64, copy=True)
    t = np.empty_like(x)
    with np.errstate(over="ignore"):  # in place: a hash of 10M ids makes two arrays, not ten
        x += np.uint64(0x9E3779B97F4A7C15)
        np.right_shift(x, np.uint64(30), out=t)
        x ^= t
        x *= np.uint64(0xBF58476D1CE4E5B9)
        np.right_shift(x, np.uint64(27), out=t)
        x ^= t
        x *= np.uint64(0x94D049BB133111EB)
        np.right_shift(x, np.uint64(31), out=t)
        x ^= t
    return x


def stable_hash(*values: int) -> int:
    """A 63-bit hash of a tuple of integers, the same in every process and Python version."""
    h = 0
    for v in values:
        h = _splitmix64_int(h ^ _splitmix64_int(int(v) & _MASK64))
    return h >> 1


def batch_seeds(seed: int, epoch: int, indices: np.ndarray, rank: int) -> np.ndarray:
    """``stable_hash(seed, epoch, i, rank)`` for every i of ``indices``, vectorised: int64 [n]."""
    h = np.uint64(_splitmix64_int(_splitmix64_int(_splitmix64_int(seed & _MASK64)) ^
                                  _splitmix64_int(epoch & _MASK64)))
    x = splitmix64(h ^ splitmix64(np.asarray(indices, dtype=np.int64).astype(np.uint64)))
    x = splitmix64(x ^ np.uint64(_splitmix64_int(rank & _MASK64)))
    return (x >> np.uint64(1)).astype(np.int64)


def holdout_mask(sample_ids: np.ndarray, fraction: float) -> np.ndarray:
    """True for the samples kept out of training (for evaluation): those whose id hash, as a
    fraction of 2**64, falls below ``fraction``. Stable across processes and runs."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"holdout fraction must be in [0, 1), got {fraction}")
    threshold = np.uint64(min(int(fraction * 2.0**64), _MASK64))
    return splitmix64(sample_ids) < threshold


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the plan (a view built on demand from :class:`EpochPlan`'s columns).
    ``positions`` index the arrays the plan was built from."""

    bucket: int
    positions: np.ndarray  # int64 [S], row-major (row 0's samples first)
    row_splits: np.ndarray  # int64 [R+1]: row r holds positions[row_splits[r]:row_splits[r+1]]
    seq_len: int  # T: tokens per row after padding
    n_tokens: int  # real tokens
    index: int = -1  # batch index within the epoch on this rank
    seed: int = 0  # stable_hash(seed, epoch, index, rank)
    block_positions: int = 0  # upper bound of the drafter's block positions: sum of min(A, L-1) * B

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
    # block positions per batch (its upper bound: sum over documents of min(num_anchors, L-1) * block_size),
    # over all batches of all ranks
    block_positions: int = 0  # sum
    block_positions_median: float = 0.0
    block_positions_max: int = 0

    @property
    def padding_fraction(self) -> float:
        total = self.n_tokens + self.n_padded
        return self.n_padded / total if total else 0.0


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    seed: int
    num_anchors: int  # train.num_anchors: blocks per document, at most
    block_size: int  # model.block_size: positions per block
    world_size: int = 1
    tokens_per_batch: int = 16384
    # block positions per batch, at most; None: unbounded (the bound is still computed and reported)
    max_block_positions: int | None = None
    packing: bool = False
    row_tokens: int | None = None  # packed row length; None: tokens_per_batch (one row per batch)
    sort_window: int = 64  # batches' worth of tokens sorted by length together
    holdout_fraction: float = 0.0
    # read locality: each bucket's samples are shuffled within groups of this many parts (groups in a
    # random order), so a read-ahead window covers few parts; None: shuffled over the whole bucket
    locality_parts: int | None = None

    @classmethod
    def from_config(cls, cfg: LoaderConfig, *, seed: int, num_anchors: int, block_size: int,
                    world_size: int = 1) -> PlanSettings:
        """The settings of ``cfg`` (the loader section) for a run with this seed, anchors and block size."""
        return cls(seed=seed, num_anchors=num_anchors, block_size=block_size, world_size=world_size,
                   tokens_per_batch=cfg.tokens_per_batch, max_block_positions=cfg.max_block_positions,
                   packing=cfg.packing, row_tokens=cfg.pack_row_tokens, sort_window=cfg.sort_window,
                   holdout_fraction=cfg.holdout_fraction, locality_parts=cfg.locality_parts)

    def pack_row_tokens(self) -> int:
        return self.row_tokens or self.tokens_per_batch

    def block_bound(self, lengths: np.ndarray) -> np.ndarray:
        """int64 [N]: the block positions a document of each length can anchor, at most."""
        return np.minimum(self.num_anchors, np.asarray(lengths, dtype=np.int64) - 1) * self.block_size


def _index_dtype(n: int) -> type[np.signedinteger]:
    return np.int32 if n < 2**31 else np.int64


class PlannedBatches(Sequence[PlannedBatch]):
    """The batches of an :class:`EpochPlan`, each built on demand from its columns."""

    def __init__(self, plan: EpochPlan):
        self._plan = plan

    def __len__(self) -> int:
        return len(self._plan)

    def __getitem__(self, k: int | slice) -> PlannedBatch | list[PlannedBatch]:  # type: ignore[override]
        if isinstance(k, slice):
            return [self._plan.batch(i) for i in range(*k.indices(len(self)))]
        return self._plan.batch(k)


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """This rank's batches for one epoch (or one live window of it), as columns: batch k holds rows
    ``batch_rows[k] .. batch_rows[k+1]``, row r holds ``positions[row_starts[r]:row_starts[r+1]]``."""

    epoch: int
    window: int
    rank: int
    first_index: int  # batch index of batch 0 (live windows continue the numbering of the epoch)
    positions: np.ndarray  # int32/int64 [S]: indices into the planned arrays, batch by batch, row by row
    row_starts: np.ndarray  # int32/int64 [R+1]
    batch_rows: np.ndarray  # int64 [nb+1]
    bucket: np.ndarray  # int64 [nb]
    seq_len: np.ndarray  # int64 [nb] tokens per row after padding
    n_tokens: np.ndarray  # int64 [nb] real tokens
    block_positions: np.ndarray  # int64 [nb] upper bound of block positions
    seed: np.ndarray  # int64 [nb] stable_hash(seed, epoch, index, rank)
    stats: PlanStats
    identity: str  # hash of everything the plan depends on (checked on resume)

    def __len__(self) -> int:
        return len(self.bucket)

    @property
    def batches(self) -> PlannedBatches:
        return PlannedBatches(self)

    def batch(self, k: int) -> PlannedBatch:
        if not -len(self) <= k < len(self):
            raise IndexError(f"batch {k} of a plan with {len(self)} batches")
        k %= len(self)
        r0, r1 = int(self.batch_rows[k]), int(self.batch_rows[k + 1])
        starts = self.row_starts[r0:r1 + 1].astype(np.int64)
        positions = self.positions[starts[0]:starts[-1]].astype(np.int64)
        return PlannedBatch(bucket=int(self.bucket[k]), positions=positions, row_splits=starts - starts[0],
                            seq_len=int(self.seq_len[k]), n_tokens=int(self.n_tokens[k]),
                            index=self.first_index + k, seed=int(self.seed[k]),
                            block_positions=int(self.block_positions[k]))


class Planner:
    """Plans epochs over one set of index arrays. Validation, the canonical order, the holdout and the
    digest of the data are computed once here; :meth:`plan` builds one epoch (or live window)."""

    def __init__(self, sample_ids: np.ndarray, lengths: np.ndarray, buckets: np.ndarray, settings: PlanSettings,
                 parts: np.ndarray | None = None):
        _check_settings(settings)
        self.settings = s = settings
        # the part of each sample (``locality_parts``); a plan without them shuffles over whole buckets
        self.parts = np.asarray(parts, dtype=np.int64) if parts is not None and s.locality_parts else None
        ids = np.asarray(sample_ids, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        bk = np.asarray(buckets)
        if len(ids) != len(self.lengths) or len(ids) != len(bk):
            raise DataError(f"index arrays disagree: {len(ids)} sample ids, {len(self.lengths)} lengths, "
                            f"{len(bk)} buckets")
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        if len(ids) > 1 and np.any(sorted_ids[1:] == sorted_ids[:-1]):
            dup = sorted_ids[1:][sorted_ids[1:] == sorted_ids[:-1]][:5].tolist()
            raise DataError(f"the cache index holds duplicate sample ids (e.g. {dup}); run `dflash-cache verify`")
        held = holdout_mask(sorted_ids, s.holdout_fraction) if s.holdout_fraction > 0 else np.zeros(len(ids), bool)
        positions = order[~held]  # training samples in id order
        self.n_holdout, self.n_samples = int(held.sum()), len(positions)
        if self.n_samples < s.world_size:
            raise DataError(
                f"{self.n_samples} training samples ({len(ids)} in the index, {self.n_holdout} held out) "
                f"cannot give each of {s.world_size} ranks a batch; extract more data or lower "
                "loader.holdout_fraction"
            )
        lengths_p, bk_p = self.lengths[positions], bk[positions]
        _check_lengths(lengths_p, s)
        grouped = positions[np.argsort(_small_keys(bk_p), kind="stable")].astype(_index_dtype(len(ids)))
        counts = np.bincount(bk_p)
        self.groups = [(b, g) for b, g in enumerate(np.split(grouped, np.cumsum(counts)[:-1])) if len(g)]
        h = hashlib.sha256()
        for a, dtype in ((sorted_ids[~held], np.int64), (lengths_p, np.int32), (bk_p, np.int16)):
            h.update(np.ascontiguousarray(a, dtype=dtype).tobytes())
        if self.parts is not None:  # the locality units are part of what the plan depends on
            h.update(np.ascontiguousarray(self.parts[positions], dtype=np.int64).tobytes())
        self.digest = h.hexdigest()

    def plan(self, epoch: int, *, rank: int = 0, window: int = 0, first_index: int = 0) -> EpochPlan:
        """This rank's batches for ``epoch`` (``window`` numbers live-mode windows within it).

        ``first_index`` is the batch index the first batch of this plan gets (live windows
        continue the numbering of the epoch)."""
        s = self.settings
        if not 0 <= rank < s.world_size:
            raise ConfigError(f"rank must be in [0, world_size={s.world_size}), got {rank}")
        key = (s.seed, epoch, window)
        cut = _Cut(self.lengths, s, self.parts)
        for b, pos in self.groups:
            cut.add_bucket(b, pos, np.random.default_rng([*key, b]))
        ordered = cut.interleave(np.random.default_rng([*key, 1 << 20]))
        n_split = cut.balance(ordered, s.world_size)
        h = hashlib.sha256()
        settings = repr(s) if self.parts is not None else repr(s).replace(
            f", locality_parts={s.locality_parts!r}", "")  # (plans without locality keep their identity)
        h.update(repr((PLAN_VERSION, settings, epoch, window, rank)).encode())
        h.update(self.digest.encode())
        return cut.epoch_plan(ordered[rank::s.world_size], epoch=epoch, window=window, rank=rank,
                              first_index=first_index, stats=ordered.stats(self.n_samples, self.n_holdout, n_split),
                              identity=h.hexdigest()[:16])


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
    """This rank's batches for ``epoch`` over these arrays (see :class:`Planner` to plan several epochs)."""
    return Planner(sample_ids, lengths, buckets, settings).plan(epoch, rank=rank, window=window,
                                                                first_index=first_index)


def plan_from_index(index: Any, cfg: LoaderConfig, *, seed: int, num_anchors: int, block_size: int,
                    world_size: int = 1, epoch: int = 0, rank: int = 0) -> EpochPlan:
    """The plan of one epoch over every committed sample of a cache index (``cache.index()``), with the
    loader section ``cfg`` of a run: what the trainer's loader would plan, without building a loader."""
    settings = PlanSettings.from_config(cfg, seed=seed, num_anchors=num_anchors, block_size=block_size,
                                        world_size=world_size)
    return build_plan(index.sample_ids, index.lengths, index.buckets, settings, epoch=epoch, rank=rank)


def _check_settings(s: PlanSettings) -> None:
    if s.world_size < 1:
        raise ConfigError(f"world_size must be positive, got {s.world_size}")
    if s.tokens_per_batch < 1 or s.sort_window < 1:
        raise ConfigError("loader.tokens_per_batch and loader.sort_window must be positive")
    if s.num_anchors < 1 or s.block_size < 1 or (s.max_block_positions is not None and s.max_block_positions < 1):
        raise ConfigError("train.num_anchors, model.block_size and loader.max_block_positions must be positive")
    if s.packing and s.pack_row_tokens() > s.tokens_per_batch:
        raise ConfigError(
            f"loader.pack_row_tokens={s.row_tokens} exceeds loader.tokens_per_batch={s.tokens_per_batch}; "
            "a batch must hold at least one packed row"
        )


def _check_lengths(lengths: np.ndarray, s: PlanSettings) -> None:
    if not lengths.size:
        return
    if lengths.min() < 1:
        raise DataError("the cache index holds a sample of length 0; run `dflash-cache verify`")
    longest = int(lengths.max())
    limit = s.pack_row_tokens() if s.packing else s.tokens_per_batch
    if longest > limit:
        key = "loader.pack_row_tokens" if s.packing and s.row_tokens else "loader.tokens_per_batch"
        raise ConfigError(
            f"the longest training sample has {longest} tokens but {key}={limit}; "
            f"set {key} >= {longest} (samples are never truncated)"
        )
    need = int(s.block_bound(np.array([longest]))[0])
    if s.max_block_positions is not None and need > s.max_block_positions:
        blocks = min(s.num_anchors, longest - 1)
        raise ConfigError(
            f"the longest training sample ({longest} tokens) can anchor {blocks} blocks (train.num_anchors="
            f"{s.num_anchors}) of model.block_size={s.block_size} positions: {need} block positions, more than "
            f"loader.max_block_positions={s.max_block_positions} allows in a whole batch; set "
            f"loader.max_block_positions >= {need}, or lower train.num_anchors"
        )


def _ranges(lo: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(lo[i], lo[i] + counts[i])`` over i (int64)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    first = np.cumsum(counts) - counts  # where each range starts in the output
    return np.repeat(np.asarray(lo, dtype=np.int64) - first, counts) + np.arange(total, dtype=np.int64)


def _small_keys(a: np.ndarray) -> np.ndarray:
    """``a`` (non-negative ints) as uint16 when it fits: numpy's stable sort is then a radix sort, O(n)."""
    return a.astype(np.uint16) if not len(a) or int(a.max()) < 2**16 else a


def _sort_within_windows(lens: np.ndarray, wid: np.ndarray) -> np.ndarray:
    """The order that sorts samples by (window, length), stable: by length first, then (stably) by window."""
    by_len = np.argsort(_small_keys(lens), kind="stable")
    return by_len[np.argsort(_small_keys(wid[by_len]), kind="stable")]


def _padded_token_end(lens: np.ndarray, wid: np.ndarray, budget: int) -> np.ndarray:
    """For each start s: the first j (in s's window) with ``(j - s + 1) * lens[j] > budget``.

    Within a window (``wid``: window of each sample, ascending) ``lens`` ascends, so
    ``d[j] = j + 1 - budget // lens[j]`` strictly increases and j fits a batch started at s iff
    ``d[j] <= s``: one searchsorted. An offset per window keeps the keys sorted across windows,
    and makes the search stop at the window's end."""
    n = len(lens)
    j = np.arange(n, dtype=np.int64)
    stride = n + budget + 1
    keys = j + 1 - budget // lens + wid * stride
    return np.searchsorted(keys, j + wid * stride, side="right")


def _cut_starts(cap_end: np.ndarray, weight: np.ndarray, budget: int | None) -> np.ndarray:
    """Starts of the greedy cut of a sequence of rows into batches: a batch started at row s takes the
    rows j < ``cap_end[s]`` (token budget, sort window) while the sum of their ``weight`` (block
    positions) stays within ``budget``. The ends are computed for every s at once; one Python step
    per batch then follows them from row 0."""
    if budget is None:
        end = cap_end
    else:
        cum = np.cumsum(weight)
        end = np.minimum(cap_end, np.searchsorted(cum, cum - weight + budget, side="right"))
    nxt = memoryview(np.ascontiguousarray(end, dtype=np.int64))  # Python ints on access, no 8N-byte list
    n, s, starts = len(end), 0, []
    while s < n:
        starts.append(s)
        s = nxt[s]
    return np.asarray(starts, dtype=np.int64)


class _Cut:
    """The batches of one epoch, as they are formed bucket by bucket. Rows are ranges of ``positions``
    (``row_lo``/``row_hi``); a batch is a range ``[r0, r1)`` of rows, whose positions are contiguous."""

    def __init__(self, lengths: np.ndarray, s: PlanSettings, parts: np.ndarray | None = None):
        self.lengths, self.s, self.parts = lengths, s, parts
        self._pos: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []  # row starts (into the concatenated positions), per bucket
        self._batches: list[_Order] = []  # each bucket's batches, in shuffled order
        self._n_pos = self._n_rows = 0

    # ---- forming batches

    def add_bucket(self, bucket: int, pos: np.ndarray, rng: np.random.Generator) -> None:
        s = self.s
        grp = None
        if self.parts is None:
            pos = pos[rng.permutation(len(pos))]
        else:  # shuffled within groups of locality_parts parts, the groups in a random order
            uniq, inv = np.unique(self.parts[pos], return_inverse=True)
            grp = (rng.permutation(len(uniq))[inv] // s.locality_parts).astype(np.int64)
            order = np.lexsort((rng.random(len(pos)), grp))
            pos, grp = pos[order], grp[order]
        lens = self.lengths[pos]
        cum = np.cumsum(lens)
        window_tokens = s.sort_window * s.tokens_per_batch
        cuts = np.searchsorted(cum, np.arange(1, int(cum[-1] // window_tokens) + 1) * window_tokens, side="right")
        wid = np.searchsorted(cuts, np.arange(len(pos)), side="right")  # sort window of each sample
        if grp is not None:  # windows (and so batches) end at group boundaries too
            wid = grp * (len(cuts) + 1) + wid
        if s.packing:
            row_starts, order, wid_rows = self._pack(pos, lens, wid)
            pos = pos[order]
            fill = np.add.reduceat(self.lengths[pos], row_starts[:-1])
            bp = np.add.reduceat(s.block_bound(self.lengths[pos]), row_starts[:-1])
            cap_end = np.minimum(np.arange(len(fill)) + max(1, s.tokens_per_batch // s.pack_row_tokens()),
                                 np.searchsorted(wid_rows, wid_rows, side="right"))  # rows per batch, window end
        else:  # one sample per row: each window ascending by length (stable in the shuffled order)
            order = _sort_within_windows(lens, wid)
            pos, fill, wid_rows = pos[order], lens[order], wid[order]
            row_starts = np.arange(len(pos) + 1, dtype=np.int64)
            bp = s.block_bound(fill)
            cap_end = _padded_token_end(fill, wid_rows, s.tokens_per_batch)
        starts = _cut_starts(cap_end, bp, s.max_block_positions)
        r0 = starts + self._n_rows
        r1 = np.append(starts[1:], len(fill)) + self._n_rows
        if grp is None:
            perm = rng.permutation(len(starts))
        else:  # batches shuffled within their group (that of their first sample): groups stay in order
            perm = np.lexsort((rng.random(len(starts)), grp[order][row_starts[starts]]))
        batches = _Order(np.full(len(starts), bucket, dtype=np.int64), r0, r1, np.maximum.reduceat(fill, starts),
                         np.add.reduceat(fill, starts), np.add.reduceat(bp, starts))
        self._batches.append(batches[perm])
        self._pos.append(pos)
        self._rows.append(row_starts[:-1] + self._n_pos)
        self._n_pos += len(pos)
        self._n_rows += len(fill)

    def _pack(self, pos: np.ndarray, lens: np.ndarray, wid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Packed rows per window: longest first onto the emptiest row (rows pre-opened for the window's
        tokens and block positions); a sample that would break either budget of the emptiest row opens a new
        one. Returns (row starts [R+1] into the reordered samples, that order [N], window of each row [R]),
        rows ordered by fill within each window."""
        cap, s = self.s.pack_row_tokens(), self.s
        cap_bp = s.max_block_positions if s.max_block_positions is not None else np.iinfo(np.int64).max
        bp = s.block_bound(lens)
        order = np.lexsort((-lens, wid))  # each window longest first (stable)
        n_windows = int(wid[-1]) + 1
        w_tokens = np.bincount(wid, weights=lens, minlength=n_windows)
        w_bp = np.bincount(wid, weights=bp, minlength=n_windows)
        row_of = np.empty(len(pos), dtype=np.int64)
        row_window: list[int] = []
        w_first = np.searchsorted(wid[order], np.arange(n_windows + 1))
        for w in range(n_windows):
            k0, k1 = int(w_first[w]), int(w_first[w + 1])
            if k0 == k1:
                continue
            n_rows = max(1, -(-int(w_tokens[w]) // cap), -(-int(w_bp[w]) // cap_bp))
            base = len(row_window)
            row_window.extend([w] * n_rows)
            heap = [(0, r, 0) for r in range(base, base + n_rows)]  # (tokens, row id, block positions)
            out = []
            for n, b in zip(lens[order[k0:k1]].tolist(), bp[order[k0:k1]].tolist(), strict=True):
                fill, r, fill_bp = heap[0]
                if fill + n > cap or fill_bp + b > cap_bp:
                    r = len(row_window)
                    row_window.append(w)
                    heapq.heappush(heap, (n, r, b))
                else:
                    heapq.heapreplace(heap, (fill + n, r, fill_bp + b))
                out.append(r)
            row_of[order[k0:k1]] = out
        rows_w = np.asarray(row_window, dtype=np.int64)
        fill = np.bincount(row_of, weights=lens, minlength=len(rows_w))
        row_rank = np.empty(len(rows_w), dtype=np.int64)
        row_rank[np.lexsort((fill, rows_w))] = np.arange(len(rows_w))  # by fill within the window (stable)
        placed = np.empty(len(pos), dtype=np.int64)
        placed[order] = np.arange(len(pos))
        by_row = np.lexsort((placed, row_rank[row_of]))  # samples row by row, each row in placement order
        counts = np.bincount(row_rank[row_of], minlength=len(rows_w))
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return starts, by_row, np.sort(rows_w)

    # ---- ordering, balancing, assigning

    def interleave(self, rng: np.random.Generator) -> _Order:
        """All buckets formed: spread each bucket's batches evenly over the epoch (batch i of n at
        (i + u_b) / n) and return them in that order."""
        cat = (lambda a: np.concatenate(a)) if self._pos else (lambda a: np.zeros(0, np.int64))
        self.positions = cat(self._pos)  # [S] index dtype
        self.row_lo = cat(self._rows).astype(np.int64, copy=False)
        self.row_hi = np.append(self.row_lo[1:], self._n_pos)
        per_bucket = sorted(self._batches, key=lambda o: int(o.bucket[0]))
        keys, i = [], []
        for o in per_bucket:
            u, n = rng.random(), len(o)
            keys.append((np.arange(n) + u) / n)
            i.append(np.arange(n))
        both = _Order.concat(per_bucket)
        return both[np.lexsort((np.concatenate(i), both.bucket, np.concatenate(keys)))]

    def balance(self, o: _Order, world: int) -> int:
        """Split the batches with the most samples until every rank gets the same count."""
        n_split = 0
        while len(o.r0) % world:
            sizes = self._samples(o)
            i = len(sizes) - 1 - int(np.argmax(sizes[::-1]))  # the latest of the largest
            if sizes[i] < 2:
                raise DataError(f"cannot give {world} ranks the same number of batches: too few samples")
            r0, r1 = int(o.r0[i]), int(o.r1[i])
            if r1 - r0 >= 2:
                mid = r0 + (r1 - r0) // 2
                halves = [(r0, mid), (mid, r1)]
            else:  # one row: split it into two rows, appended to the row arrays
                lo, hi = int(self.row_lo[r0]), int(self.row_hi[r0])
                half = lo + (hi - lo) // 2
                n = len(self.row_lo)
                self.row_lo = np.append(self.row_lo, [lo, half])
                self.row_hi = np.append(self.row_hi, [half, hi])
                halves = [(n, n + 1), (n + 1, n + 2)]
            o.replace(i, [self._batch(b0, b1, int(o.bucket[i])) for b0, b1 in halves])
            n_split += 1
        return n_split

    def _batch(self, r0: int, r1: int, bucket: int) -> _Order:
        """One batch of rows [r0, r1)."""
        lens = [self.lengths[self.positions[a:b]] for a, b in zip(self.row_lo[r0:r1], self.row_hi[r0:r1], strict=True)]
        fill = np.array([int(x.sum()) for x in lens])
        bp = sum(int(self.s.block_bound(x).sum()) for x in lens)
        return _Order(np.array([bucket]), np.array([r0]), np.array([r1]), fill.max(keepdims=True),
                      fill.sum(keepdims=True), np.array([bp]))

    def _samples(self, o: _Order) -> np.ndarray:
        """Samples of each batch: a batch's rows cover one contiguous range of ``positions``."""
        return self.row_hi[o.r1 - 1] - self.row_lo[o.r0]

    def epoch_plan(self, o: _Order, *, epoch: int, window: int, rank: int, first_index: int, stats: PlanStats,
                   identity: str) -> EpochPlan:
        counts = o.r1 - o.r0
        dt = _index_dtype(max(len(self.lengths), len(self.positions) + 1))
        positions = self.positions[_ranges(self.row_lo[o.r0], self._samples(o))].astype(dt)
        if self.s.packing:
            rows = _ranges(o.r0, counts)
            row_starts = np.concatenate([[0], np.cumsum(self.row_hi[rows] - self.row_lo[rows])]).astype(dt)
        else:  # one sample per row (a split of a padded batch splits its rows, never a row)
            row_starts = np.arange(len(positions) + 1, dtype=dt)
        return EpochPlan(
            epoch=epoch, window=window, rank=rank, first_index=first_index, positions=positions,
            row_starts=row_starts,
            batch_rows=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            bucket=o.bucket, seq_len=o.seq_len, n_tokens=o.n_tokens, block_positions=o.block_positions,
            seed=batch_seeds(self.s.seed, epoch, first_index + np.arange(len(counts)), rank),
            stats=stats, identity=identity,
        )


class _Order:
    """Batches in epoch order (int64 [nb] columns): bucket, row range [r0, r1), padded row length, tokens
    and block positions."""

    def __init__(self, bucket: np.ndarray, r0: np.ndarray, r1: np.ndarray, seq_len: np.ndarray,
                 n_tokens: np.ndarray, block_positions: np.ndarray):
        self.bucket, self.r0, self.r1 = bucket, r0, r1
        self.seq_len, self.n_tokens, self.block_positions = seq_len, n_tokens, block_positions

    def _columns(self) -> tuple[np.ndarray, ...]:
        return self.bucket, self.r0, self.r1, self.seq_len, self.n_tokens, self.block_positions

    @classmethod
    def concat(cls, parts: list[_Order]) -> _Order:
        if not parts:
            return cls(*(np.zeros(0, np.int64) for _ in range(6)))
        return cls(*(np.concatenate(c) for c in zip(*(p._columns() for p in parts), strict=True)))

    def __len__(self) -> int:
        return len(self.r0)

    def __getitem__(self, k: slice | np.ndarray) -> _Order:
        return _Order(*(c[k] for c in self._columns()))

    def replace(self, i: int, halves: list[_Order]) -> None:
        """Batch i becomes the two batches ``halves``."""
        new = _Order.concat([self[:i], *halves, self[i + 1:]])
        self.bucket, self.r0, self.r1, self.seq_len, self.n_tokens, self.block_positions = new._columns()

    def stats(self, n_samples: int, n_holdout: int, n_split: int) -> PlanStats:
        bp, rows = self.block_positions, self.r1 - self.r0
        buckets, counts = np.unique(self.bucket, return_counts=True)
        return PlanStats(
            n_samples=n_samples, n_holdout=n_holdout, n_tokens=int(self.n_tokens.sum()),
            n_padded=int((rows * self.seq_len).sum() - self.n_tokens.sum()), n_batches=len(rows),
            n_split=n_split, batches_per_bucket={int(b): int(c) for b, c in zip(buckets, counts, strict=True)},
            block_positions=int(bp.sum()), block_positions_median=float(np.median(bp)) if len(bp) else 0.0,
            block_positions_max=int(bp.max()) if len(bp) else 0,
        )

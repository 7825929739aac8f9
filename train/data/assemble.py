"""Batch assembly: planned rows of samples -> one padded :class:`~train.data.batch.Batch` in host memory.

Each sample's features are decoded from its cache part straight into its place in the batch
tensor (no per-sample tensors, no second copy), in pieces of a few chunks spread over decode
threads (blosc runs without the GIL), so even one batch in flight keeps every thread busy. The
batch tensors come from a :class:`~train.data.batch.BatchBufferPool` (reusable, pinned with a GPU).
With a ``read_fn`` (tests inject slow or failing reads with it) the samples it returns are
collated into those buffers instead.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dflash_cache.parts import PartInfo
from dflash_cache.protocols import ReadableCache
from dflash_cache.reader import PartReaderCache

from .batch import Batch, BatchBufferPool, carve_batch, host_buffer, padded_nbytes

_PIECE_CHUNKS = 2  # a decode task: features of at most this many (aligned) inner chunks of a sample
# bytes per token slot besides the features: input_ids int64 + loss_mask bool + doc_ids int32 + position_ids int64
_SLOT_BYTES = 8 + 1 + 4 + 8


class SampleLike(Protocol):
    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    features: torch.Tensor  # bf16 [T, n*H]


ReadFn = Callable[[Sequence[int]], Sequence[SampleLike]]
Alloc = Callable[[int, int], dict[str, torch.Tensor]]  # (rows, seq_len) -> uninitialised batch tensors


@dataclass(frozen=True)
class SampleTable:
    """Where the samples a plan was built from live: its positions index these arrays."""

    sample_ids: np.ndarray  # int64 [N]
    lengths: np.ndarray  # int32 [N] tokens
    buckets: np.ndarray  # int16 [N]
    part: np.ndarray  # int32 [N] into ``parts``
    row: np.ndarray  # int32 [N] position within its part
    parts: list[PartInfo]

    def __len__(self) -> int:
        return len(self.sample_ids)


def batch_nbytes(num_rows: int, seq_len: int, n_samples: int, feature_dim: int) -> int:
    """Host bytes of an assembled batch."""
    return num_rows * seq_len * (feature_dim * 2 + _SLOT_BYTES) + n_samples * 8


def _fresh(feature_dim: int, pin: bool) -> Alloc:
    return lambda rows, seq_len: carve_batch(host_buffer(padded_nbytes(rows, seq_len, feature_dim), pin), rows,
                                              seq_len, feature_dim)


def _init_padding(t: dict[str, torch.Tensor]) -> None:
    """Padding values everywhere but the features (whose padding is zeroed row by row)."""
    t["input_ids"].zero_()
    t["loss_mask"].zero_()
    t["doc_ids"].fill_(-1)
    t["position_ids"].zero_()


def collate(rows: Sequence[Sequence[SampleLike]], feature_dim: int, pin: bool = False,
            alloc: Alloc | None = None) -> dict[str, torch.Tensor]:
    """Rows of documents -> padded tensors (documents back to back within a row). ``alloc`` gives the
    (uninitialised) tensors, e.g. from a :class:`~train.data.batch.BatchBufferPool`."""
    R = len(rows)
    T = max(sum(int(s.input_ids.shape[0]) for s in row) for row in rows)
    t = (alloc or _fresh(feature_dim, pin))(R, T)  # features [R, T, n*H], the rest [R, T]
    _init_padding(t)
    features = t["features"]
    ramp = torch.arange(T, dtype=torch.int64)
    for r, row in enumerate(rows):
        off = 0
        for d, s in enumerate(row):
            n = int(s.input_ids.shape[0])
            features[r, off:off + n] = s.features
            t["input_ids"][r, off:off + n] = s.input_ids
            t["loss_mask"][r, off:off + n] = s.loss_mask
            t["doc_ids"][r, off:off + n] = d
            t["position_ids"][r, off:off + n] = ramp[:n]
            off += n
        features[r, off:] = 0
    return t


class BatchAssembler:
    """Assembles batches of a cache into pooled host buffers (thread-safe: the loader's readers share it).

    ``read_fn`` replaces decoding from the cache's parts by collating the samples it returns."""

    def __init__(self, cache: ReadableCache, pool: BatchBufferPool, feature_dim: int, decode_threads: int,
                 read_fn: ReadFn | None = None, storage: Any = None):
        self.pool, self.feature_dim = pool, feature_dim
        self._read = read_fn or cache.read_samples
        # decode straight into batch buffers unless reads are injected (or the cache has no byte storage);
        # ``storage``: the cache's storage seen through a read-ahead
        storage = storage or getattr(cache, "storage", None)
        self._readers = PartReaderCache(storage, capacity=256) if read_fn is None and storage is not None else None
        self._decoders = None  # threads that decode pieces of batches (blosc runs without the GIL)
        if self._readers is not None and decode_threads > 1:
            self._decoders = concurrent.futures.ThreadPoolExecutor(decode_threads, thread_name_prefix="dflash-decode")

    def assemble(self, table: SampleTable, rows: list[list[int]], *, bucket: int, epoch: int, index: int,
                 seed: int) -> Batch:
        """The batch of ``rows`` (positions into ``table``; documents back to back within a row)."""
        ids = table.sample_ids[[p for r in rows for p in r]]
        if self._readers is None:
            it = iter(self._read(ids.tolist()))
            t = collate([[next(it) for _ in r] for r in rows], self.feature_dim, alloc=self._alloc)
        else:
            t = self._decode(table, rows)
        n_tokens = int(t["doc_ids"].ge(0).sum())
        return Batch(**t, sample_ids=torch.from_numpy(ids.astype(np.int64)), bucket=bucket, epoch=epoch,
                     index=index, n_tokens=n_tokens, n_padded=t["input_ids"].numel() - n_tokens, seed=seed)

    def reader(self, part: PartInfo) -> Any:
        """The (cached) :class:`~dflash_cache.reader.PartReader` of ``part``."""
        assert self._readers is not None
        return self._readers.get(part)

    def close(self) -> None:
        if self._decoders is not None:
            self._decoders.shutdown(wait=True)
            self._decoders = None

    def _alloc(self, rows: int, seq_len: int) -> dict[str, torch.Tensor]:
        return self.pool.batch_tensors(rows, seq_len, self.feature_dim)

    def _decode(self, table: SampleTable, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """Each document decoded straight into its place in the (pooled) batch tensors; the features in
        pieces of a few chunks, spread over the decode threads."""
        assert self._readers is not None
        seq_len = max(int(table.lengths[r].sum()) for r in rows)
        t = self._alloc(len(rows), seq_len)  # features [R, T, n*H], the rest [R, T]
        _init_padding(t)
        features = t["features"]
        pieces = []
        for r, row in enumerate(rows):
            off = 0
            for d, p in enumerate(row):
                reader = self._readers.get(table.parts[int(table.part[p])])
                a, b = reader.span(int(table.row[p]))
                n = b - a
                t["input_ids"][r, off:off + n] = torch.from_numpy(reader.small("input_ids")[a:b])
                t["loss_mask"][r, off:off + n] = torch.from_numpy(reader.small("loss_mask")[a:b])
                t["doc_ids"][r, off:off + n] = d
                t["position_ids"][r, off:off + n] = torch.arange(n, dtype=torch.int64)
                step = _PIECE_CHUNKS * reader.part.chunk_tokens if self._decoders is not None else b
                cuts = [a, *range((a // step + 1) * step, b, step), b]  # chunk-aligned inner cuts
                for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                    pieces.append((reader, lo, hi, features[r, off + lo - a:off + hi - a]))
                off += n
            features[r, off:] = 0
        self._decode_pieces(pieces)
        return t

    def _decode_pieces(self, pieces: list[tuple[Any, int, int, torch.Tensor]]) -> None:
        if self._decoders is None or len(pieces) == 1:
            for reader, lo, hi, dest in pieces:
                reader.read_tokens_into(lo, hi, dest)
            return
        futures = [self._decoders.submit(reader.read_tokens_into, lo, hi, dest) for reader, lo, hi, dest in pieces]
        concurrent.futures.wait(futures)  # every piece done (or failed) before the buffer can be dropped
        for f in futures:
            f.result()  # the first failure, in batch order

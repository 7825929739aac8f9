"""Reading committed parts: the index from small arrays, and samples decoded straight from shard bytes.

The hot path does not go through zarr-python: it reads a shard's index (cached), reads each inner
chunk a request needs into a per-thread buffer, checks its crc32c while it is still in the CPU cache
and decodes it with blosc (GIL released) straight into the destination -- a fresh array, or the
caller's buffer (``read_tokens_into``, ``read_rows(out=...)``: e.g. a slice of a reused batch
tensor). Of a chunk that a request covers only in part, only the blosc blocks it overlaps are
decoded. The layout it reads is plain zarr v3 (sharding codec, ``bytes`` -> ``blosc`` -> ``crc32c``),
so any zarr implementation can read the same cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .codecs import (
    ChecksumError,
    ChunkDecoder,
    crc32c,
    dequantize_fp8,
    index_from_chunk_table,
    inline_decode,
    scratch_buffer,
    u16_to_bf16,
)
from .errors import CacheCorruptError
from .parts import PartInfo
from .storage import Storage

_EMPTY = np.uint64(2**64 - 1)


_SCRATCH_MAX = 64 << 20  # larger temporaries are allocated per call, not kept per thread


_SMALL_DECODER = ChunkDecoder(blosc=True, crc=True)
_RAW_DECODER = ChunkDecoder(blosc=False, crc=True)
_KEPT = ("sample_ids", "offsets")  # small arrays a remote storage keeps once read (Storage.small_arrays)


@dataclass
class Sample:
    """One sample at its true length ``T``."""

    sample_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    features: torch.Tensor  # bf16 [T, n*H]
    target_argmax: torch.Tensor | None  # int64 [T]
    bucket: int
    part: str  # the part's name


@dataclass(frozen=True)
class ArrayLayout:
    """Where an array's chunks are and how they are encoded (rows = the token axis)."""

    key: str  # array prefix, e.g. buckets/0/u1/features
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int  # inner chunk length (sharded) or chunk length
    shard_rows: int | None  # None: unsharded
    decoder: ChunkDecoder
    # binding to the commit record: the crc32c ending each shard's index (sharded arrays), or of the
    # whole array (small arrays); None in records written before they were recorded
    index_crcs: tuple[int, ...] | None = None
    crc32c: int | None = None
    # copies the commit record keeps (records written since they were kept; None before): each shard's
    # chunk table (codecs.chunk_table) and a small array's values (codecs.inline_encode)
    chunk_tables: tuple[str, ...] | None = None
    inline: str | None = None

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    def chunk_key(self, unit: int) -> str:
        tail = "/0" * (len(self.shape) - 1)
        return f"{self.key}/c/{unit}{tail}"


def feature_decoder(codec: str) -> ChunkDecoder:
    return _RAW_DECODER if codec == "bf16-raw" else _SMALL_DECODER


def layouts_for(part: PartInfo) -> dict[str, ArrayLayout]:
    """Array layouts from the commit record alone (the writer's fixed layout; no zarr.json read)."""
    out = {}
    for name, a in part.arrays.items():
        shape = tuple(int(s) for s in a["shape"])
        if name in ("features", "scales"):
            dec = feature_decoder(part.codec) if name == "features" else _SMALL_DECODER
            crcs, tables = a.get("shard_index_crc32c"), a.get("shard_chunks")
            out[name] = ArrayLayout(f"{part.data_key}/{name}", shape, np.dtype(a["dtype"]), part.chunk_tokens,
                                    part.shard_tokens, dec, index_crcs=None if crcs is None else tuple(crcs),
                                    chunk_tables=None if tables is None or crcs is None else tuple(tables))
        else:
            out[name] = ArrayLayout(f"{part.data_key}/{name}", shape, np.dtype(a["dtype"]), max(shape[0], 1), None,
                                    _SMALL_DECODER, crc32c=a.get("crc32c"),
                                    inline=a.get("inline") if a.get("crc32c") is not None else None)
    return out


class ArrayReader:
    """Reads row ranges of one array. Thread-safe; caches shard indexes."""

    def __init__(self, storage: Storage, layout: ArrayLayout, part_key: str):
        self.storage, self.layout, self.part_key = storage, layout, part_key
        self._index_cache: dict[int, np.ndarray] = {}
        self._chunk_crcs: dict[int, np.ndarray] = {}  # per shard, from the commit record's chunk table
        self._lock = threading.Lock()
        self._index_lock = threading.Lock()  # held while a shard index is fetched

    def _corrupt(self, what: str) -> CacheCorruptError:
        name = self.layout.key.rsplit("/", 1)[-1]
        return CacheCorruptError(f"part {self.part_key}, array {name}: {what}; run `dflash-cache verify` and "
                                 "re-extract this part (or remove it)", part=self.part_key, array=name)

    def _get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            if start is None:
                return self.storage.get(key)
            return self.storage.get_range(key, start, end)  # type: ignore[arg-type]
        except FileNotFoundError:
            raise self._corrupt(f"chunk object {key} is missing") from None

    def shard_index(self, shard: int) -> np.ndarray:
        """[n_inner, 2] uint64 (offset, nbytes) of each inner chunk of ``shard``."""
        idx = self._index_cache.get(shard)
        if idx is not None:
            return idx
        with self._index_lock:  # read once when threads ask at once
            idx = self._index_cache.get(shard)
            if idx is not None:
                return idx
            if self.layout.chunk_tables is not None:
                return self._recorded_shard_index(shard)
            return self._read_shard_index(shard)

    def _recorded_shard_index(self, shard: int) -> np.ndarray:
        """The shard's index from the commit record's chunk table (no request), checked against the index
        checksum the record also holds; each chunk read is then checked against the table's crc32c."""
        lay = self.layout
        n_inner = lay.shard_rows // lay.chunk_rows  # type: ignore[operator]
        tables, bound = lay.chunk_tables, lay.index_crcs
        try:
            idx, crcs = index_from_chunk_table(tables[shard], n_inner)  # type: ignore[index]
        except (IndexError, ValueError, TypeError) as err:
            raise self._corrupt(f"the commit record's chunk table of shard {shard} is unreadable ({err})") from None
        if bound is None or shard >= len(bound) or crc32c(idx.tobytes()) != int(bound[shard]):
            raise self._corrupt(f"the commit record's chunk table of shard {shard} disagrees with the index "
                                "checksum it records (a damaged commit record)")
        with self._lock:
            self._chunk_crcs[shard] = crcs
            self._index_cache[shard] = idx
        return idx

    def stored_shard_index(self, shard: int) -> np.ndarray:
        """The index stored at the end of the shard object itself (one request; what verify compares the
        commit record's chunk table with)."""
        return self._read_shard_index(shard, keep=False)

    def _read_shard_index(self, shard: int, keep: bool = True) -> np.ndarray:
        lay = self.layout
        n_inner = lay.shard_rows // lay.chunk_rows  # type: ignore[operator]
        want = 16 * n_inner + 4
        key = lay.chunk_key(shard)
        try:
            raw = self.storage.get_suffix(key, want)
        except FileNotFoundError:
            raise self._corrupt(f"shard {key} is missing") from None
        stored = int.from_bytes(raw[-4:], "little")
        if len(raw) < want or crc32c(raw[:-4]) != stored:
            raise self._corrupt(f"shard {key} is truncated or its index checksum fails")
        bound = lay.index_crcs
        if bound is not None and (shard >= len(bound) or int(bound[shard]) != stored):
            raise self._corrupt(f"shard {key} is not the one its commit record names (its index checksum differs: "
                                "a shard from another part or an earlier writer)")
        idx = np.frombuffer(raw[:-4], dtype="<u8").reshape(n_inner, 2)
        if keep:
            with self._lock:
                self._index_cache[shard] = idx
        return idx

    def read_all(self) -> np.ndarray:
        """The whole array, checked against the commit record's crc32c when it has one (small arrays:
        this binds them to the part)."""
        want = self.layout.crc32c
        if self.layout.inline is not None:
            return self._inline(int(want))  # type: ignore[arg-type]
        memo = self.storage.small_arrays if want is not None and self.layout.key.rsplit("/", 1)[-1] in _KEPT else None
        if memo is not None and (got := memo.get((self.layout.key, int(want)))) is not None:
            return got.copy()
        out = self.read(0, self.layout.shape[0])
        if want is not None and crc32c(out) != int(want):
            raise self._corrupt("crc32c of the data differs from the commit record (an empty, foreign or "
                                "damaged chunk)")
        if memo is not None:
            memo[(self.layout.key, int(want))] = out.copy()  # type: ignore[arg-type]
        return out

    def check_inline_copy(self, copy: np.ndarray) -> None:
        """Compare the commit record's copy of this small array (``copy``, already checked against the
        crc32c the record holds) with the stored array: a record whose copy and checksum were both changed
        after the commit (sample boundaries or ids shifted) is refused here, as ``verify`` refuses it. Once
        per array and process on remote stores (Storage.small_arrays)."""
        memo = self.storage.small_arrays
        seen = (self.layout.key, "stored copy checked", int(self.layout.crc32c or 0))
        if memo is not None and memo.get(seen):  # type: ignore[call-overload]
            return
        stored = self.read(0, self.layout.shape[0])
        if not np.array_equal(stored, copy):
            raise self._corrupt("the commit record's copy of the array differs from the stored array (the record "
                                "was changed after its commit)")
        if memo is not None:
            memo[seen] = True  # type: ignore[index]

    def _inline(self, want: int) -> np.ndarray:
        lay = self.layout
        try:
            out = inline_decode(lay.inline, lay.dtype, lay.shape[0])  # type: ignore[arg-type]
        except (ValueError, TypeError) as err:
            raise self._corrupt(f"the commit record's copy of the array is unreadable ({err})") from None
        if crc32c(out) != want:
            raise self._corrupt("the commit record's copy of the array differs from the crc32c it records (a "
                                "damaged commit record)")
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as a new C-contiguous array."""
        lay = self.layout
        out = np.empty((max(stop - start, 0), *lay.row_shape), dtype=lay.dtype)
        self.read_into(start, stop, out)
        return out

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Decode rows ``[start, stop)`` into ``out``: C-contiguous, ``[stop-start, *row_shape]``, an
        element size equal to the array's (its bytes are written as stored)."""
        lay = self.layout
        want = (max(stop - start, 0), *lay.row_shape)
        if tuple(out.shape) != want or out.dtype.itemsize != lay.dtype.itemsize or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {lay.dtype.itemsize}-byte array of shape {list(want)}, "
                             f"got {out.dtype} {list(out.shape)} (contiguous: {out.flags.c_contiguous})")
        if stop <= start:
            return
        if not (start >= 0 and stop <= lay.shape[0]):
            raise IndexError(f"rows [{start}, {stop}) outside {lay.key} with {lay.shape[0]} rows")
        dest = out.reshape(-1).view(np.uint8)
        c = lay.chunk_rows
        first, last = start // c, (stop - 1) // c
        if lay.shard_rows is None:
            for k in range(first, last + 1):
                raw = np.frombuffer(self._get(lay.chunk_key(k)), dtype=np.uint8)
                self._decode(raw, k, start, stop, dest)
            return
        per_shard = lay.shard_rows // c
        k = first
        while k <= last:
            shard = k // per_shard
            k_end = min(last, (shard + 1) * per_shard - 1)
            self._read_shard_run(shard, k, k_end, start, stop, dest)
            k = k_end + 1

    def byte_ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """``(object key, start, end)`` of the stored bytes that reading rows ``[start, stop)`` fetches:
        one range per shard run (what :meth:`read_into` asks the storage for; none for an unsharded
        array). Reads the shard indexes it needs (cached)."""
        lay = self.layout
        if stop <= start:
            return []
        c = lay.chunk_rows
        first, last = start // c, (stop - 1) // c
        if lay.shard_rows is None:
            return []  # (whole small objects: read directly)
        per_shard = lay.shard_rows // c
        out = []
        k = first
        while k <= last:
            shard = k // per_shard
            k_end = min(last, (shard + 1) * per_shard - 1)
            idx = self.shard_index(shard)[k - shard * per_shard: k_end - shard * per_shard + 1]
            if not (idx[:, 0] == _EMPTY).any():  # (a damaged shard is reported by the read itself)
                out.append((lay.chunk_key(shard), int(idx[:, 0].min()), int((idx[:, 0] + idx[:, 1]).max())))
            k = k_end + 1
        return out

    def _row_bytes(self) -> int:
        return int(np.prod(self.layout.row_shape, dtype=np.int64)) * self.layout.dtype.itemsize

    def _read_shard_run(self, shard: int, k0: int, k1: int, start: int, stop: int, dest: np.ndarray) -> None:
        lay = self.layout
        per_shard = lay.shard_rows // lay.chunk_rows  # type: ignore[operator]
        idx = self.shard_index(shard)[k0 - shard * per_shard: k1 - shard * per_shard + 1]
        key = lay.chunk_key(shard)
        if (idx[:, 0] == _EMPTY).any():
            raise self._corrupt(f"shard {key} lacks chunks that the commit record counts")
        lo, hi = int(idx[:, 0].min()), int((idx[:, 0] + idx[:, 1]).max())
        bound = self._chunk_crcs.get(shard)  # (from the commit record's chunk table, when it has one)
        first = k0 - shard * per_shard
        try:
            with self.storage.open_range(key, lo, hi) as f:
                for i, k in enumerate(range(k0, k1 + 1)):
                    off, n = int(idx[i, 0]), int(idx[i, 1])
                    want = None if bound is None else int(bound[first + i])
                    if not lay.decoder.blosc and lay.decoder.crc:
                        self._read_raw_chunk(f, off, n, k, start, stop, dest, want, key)
                        continue
                    buf = scratch_buffer("chunk", n)  # read one chunk, check and decode it while cache-hot
                    if f.read_into(off, [memoryview(buf)]) != n:
                        raise self._corrupt(f"shard {key} is truncated")
                    if want is not None:
                        self._check_bound(buf[-4:], want, k, key)
                    self._decode(buf, k, start, stop, dest)
        except FileNotFoundError:
            raise self._corrupt(f"shard {key} is missing") from None

    def _span(self, k: int, start: int, stop: int) -> tuple[int, int, int]:
        """(byte offset in chunk k, byte offset in the destination, byte count) of the requested rows."""
        c, rb = self.layout.chunk_rows, self._row_bytes()
        a, b = max(k * c, start), min((k + 1) * c, stop)
        return (a - k * c) * rb, (a - start) * rb, (b - a) * rb

    def _decode(self, raw: np.ndarray, k: int, start: int, stop: int, dest: np.ndarray) -> None:
        in_chunk, at, n = self._span(k, start, stop)
        try:
            self.layout.decoder.decode_range_into(raw, dest[at:at + n], in_chunk,
                                                  self.layout.chunk_rows * self._row_bytes())
        except ChecksumError as err:
            raise self._corrupt(f"chunk {k}: {err}") from None

    def _check_bound(self, stored: np.ndarray, want: int, k: int, key: str) -> None:
        if int.from_bytes(stored.tobytes(), "little") != want:
            raise self._corrupt(f"chunk {k} of shard {key} is not the one its commit record names (its checksum "
                                "differs: a shard from another part or an earlier writer)")

    def _read_raw_chunk(self, f, off: int, n: int, k: int, start: int, stop: int, dest: np.ndarray,
                        want: int | None = None, key: str = "") -> None:
        """An uncompressed chunk: its requested rows are read straight into ``dest`` (no copy), the rest
        of the chunk into scratch, and the crc32c runs over all of it in order."""
        in_chunk, at, count = self._span(k, start, stop)
        chunk_bytes = self.layout.chunk_rows * self._row_bytes()
        if n != chunk_bytes + 4:
            raise self._corrupt(f"chunk {k}: holds {n} bytes, expected {chunk_bytes + 4}")
        rest = scratch_buffer("chunk", n - count)
        head, tail = rest[:in_chunk], rest[in_chunk:]
        if f.read_into(off, [memoryview(head), memoryview(dest[at:at + count]), memoryview(tail)]) != n:
            raise self._corrupt(f"shard {self.layout.chunk_key(k)} is truncated")
        if want is not None:
            self._check_bound(tail[-4:], want, k, key)
        crc = crc32c(tail[:-4], crc32c(dest[at:at + count], crc32c(head)))
        if crc != int.from_bytes(tail[-4:].tobytes(), "little"):
            raise self._corrupt(f"chunk {k}: chunk checksum mismatch (stored crc32c differs from the data)")


class PartReader:
    """Reads samples of one committed part; the small arrays are loaded once and kept."""

    def __init__(self, storage: Storage, part: PartInfo):
        self.storage, self.part = storage, part
        self.layouts = layouts_for(part)
        self.readers = {name: ArrayReader(storage, lay, part.key) for name, lay in self.layouts.items()}
        self._small: dict[str, np.ndarray] = {}
        self._small_lock = threading.Lock()

    def small(self, name: str) -> np.ndarray:
        arr = self._small.get(name)
        if arr is None:
            with self._small_lock:  # read once when threads ask at once
                arr = self._small.get(name)
                if arr is None:
                    arr = self.readers[name].read_all()
                    self._small[name] = arr
                    if name in _KEPT:  # what training reads must be what verify checked: both copies, once
                        self._check_inline_copies()
        return arr

    def _check_inline_copies(self) -> None:
        """The commit record's copies of ``sample_ids`` and ``offsets`` (which the index and the sample
        boundaries come from) against the stored arrays, when the part is first read (called under the lock)."""
        for name in _KEPT:
            lay = self.layouts.get(name)
            if lay is None or lay.inline is None:
                continue
            if name not in self._small:
                self._small[name] = self.readers[name].read_all()
            self.readers[name].check_inline_copy(self._small[name])

    def span(self, row: int) -> tuple[int, int]:
        """Token range ``[start, stop)`` of the sample at position ``row`` of this part."""
        offsets = self.small("offsets")
        return int(offsets[row]), int(offsets[row + 1])

    def feature_ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        """The byte ranges reading the features (and fp8 scales) of tokens ``[start, stop)`` fetches."""
        out = self.readers["features"].byte_ranges(start, stop)
        if "scales" in self.readers:
            out += self.readers["scales"].byte_ranges(start, stop)
        return out

    def read_tokens(self, start: int, stop: int) -> torch.Tensor:
        """Features of tokens ``[start, stop)`` of this part as bf16 ``[stop-start, n*H]``."""
        out = u16_to_bf16(np.empty((max(stop - start, 0), self.layouts["features"].shape[1]), dtype=np.uint16))
        return self.read_tokens_into(start, stop, out)  # numpy memory: large arrays get huge pages

    def read_tokens_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Decode the features of tokens ``[start, stop)`` straight into ``out`` (a contiguous CPU bf16
        tensor ``[stop-start, n*H]``, e.g. a slice of a batch buffer); returns ``out``."""
        d = self.layouts["features"].shape[1]
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (stop - start, d) or not out.is_contiguous() \
                or out.device.type != "cpu":
            raise ValueError(f"out must be a contiguous CPU bfloat16 tensor [{stop - start}, {d}], got "
                             f"{out.dtype} {list(out.shape)} on {out.device}")
        if self.part.codec == "fp8-e4m3":
            n = (stop - start) * d
            q = (scratch_buffer("fp8", n) if n <= _SCRATCH_MAX else np.empty(n, np.uint8)).reshape(stop - start, d)
            self.readers["features"].read_into(start, stop, q)
            s = self.readers["scales"].read(start, stop)
            dequantize_fp8(torch.from_numpy(q), torch.from_numpy(s), out=out)
            return out
        self.readers["features"].read_into(start, stop, out.view(torch.int16).numpy())
        return out

    def read_rows(self, rows: Sequence[int], out: Sequence[torch.Tensor] | None = None) -> list[Sample]:
        """Samples at positions ``rows`` of this part, in that order. With ``out`` (one contiguous bf16
        tensor ``[T, n*H]`` per row), features are decoded into those tensors and returned as them."""
        if out is not None and len(out) != len(rows):
            raise ValueError(f"out holds {len(out)} tensors for {len(rows)} rows")
        ids, input_ids, mask = self.small("sample_ids"), self.small("input_ids"), self.small("loss_mask")
        argmax = self.small("target_argmax") if self.part.has_target_argmax else None
        samples = []
        for i, r in enumerate(rows):
            a, b = self.span(r)
            feats = self.read_tokens(a, b) if out is None else self.read_tokens_into(a, b, out[i])
            samples.append(Sample(
                sample_id=int(ids[r]),
                input_ids=torch.from_numpy(input_ids[a:b].astype(np.int64)),
                loss_mask=torch.from_numpy(mask[a:b].astype(bool)),
                features=feats,
                target_argmax=None if argmax is None else torch.from_numpy(argmax[a:b].astype(np.int64)),
                bucket=self.part.bucket, part=self.part.name,
            ))
        return samples


class PartReaderCache:
    """A small LRU of :class:`PartReader` objects keyed by part key."""

    def __init__(self, storage: Storage, capacity: int = 64):
        self.storage, self.capacity = storage, capacity
        self._items: OrderedDict[str, PartReader] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, part: PartInfo) -> PartReader:
        with self._lock:
            r = self._items.get(part.key)
            if r is not None:
                self._items.move_to_end(part.key)
                return r
        with self._lock:  # (created under the lock: threads asking at once share one reader, read once)
            r = self._items.get(part.key)
            if r is not None:
                return r
            r = PartReader(self.storage, part)
            self._items[part.key] = r
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return r

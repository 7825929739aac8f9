"""Reading committed parts: the index from small arrays, and samples decoded straight from shard bytes.

The hot path does not go through zarr-python: it reads a shard's index (cached), fetches the byte
range of the inner chunks a request needs in one read, checks each chunk's crc32c and decodes it
with blosc directly into the output buffer. The layout it reads is plain zarr v3 (sharding codec,
``bytes`` -> ``blosc`` -> ``crc32c``), so any zarr implementation can read the same cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .codecs import ChecksumError, ChunkDecoder, crc32c, dequantize_fp8, u16_to_bf16
from .errors import CacheCorruptError
from .parts import PartInfo
from .storage import Storage

_EMPTY = np.uint64(2**64 - 1)
_scratch = threading.local()  # per-thread reusable buffers: fresh pages cost more than decoding here


def _scratch_bytes(n: int) -> memoryview:
    buf = getattr(_scratch, "bytes", None)
    if buf is None or len(buf) < n:
        buf = _scratch.bytes = bytearray(max(n, 1 << 20))
    return memoryview(buf)[:n]


def _scratch_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    n = int(np.prod(shape)) * dtype.itemsize
    buf = getattr(_scratch, "chunk", None)
    if buf is None or len(buf) < n:
        buf = _scratch.chunk = bytearray(n)
    return np.frombuffer(buf, dtype=np.uint8, count=n).view(dtype).reshape(shape)
_SMALL_DECODER = ChunkDecoder(blosc=True, crc=True)
_RAW_DECODER = ChunkDecoder(blosc=False, crc=True)


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
            out[name] = ArrayLayout(f"{part.key}/{name}", shape, np.dtype(a["dtype"]), part.chunk_tokens,
                                    part.shard_tokens, dec)
        else:
            out[name] = ArrayLayout(f"{part.key}/{name}", shape, np.dtype(a["dtype"]), max(shape[0], 1), None,
                                    _SMALL_DECODER)
    return out


class ArrayReader:
    """Reads row ranges of one array. Thread-safe; caches shard indexes."""

    def __init__(self, storage: Storage, layout: ArrayLayout, part_key: str):
        self.storage, self.layout, self.part_key = storage, layout, part_key
        self._index_cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

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
        lay = self.layout
        n_inner = lay.shard_rows // lay.chunk_rows  # type: ignore[operator]
        want = 16 * n_inner + 4
        key = lay.chunk_key(shard)
        try:
            raw = self.storage.get_suffix(key, want)
        except FileNotFoundError:
            raise self._corrupt(f"shard {key} is missing") from None
        if len(raw) < want or crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise self._corrupt(f"shard {key} is truncated or its index checksum fails")
        idx = np.frombuffer(raw[:-4], dtype="<u8").reshape(n_inner, 2)
        with self._lock:
            self._index_cache[shard] = idx
        return idx

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as a new C-contiguous array."""
        lay = self.layout
        out = np.empty((stop - start, *lay.row_shape), dtype=lay.dtype)
        if stop <= start:
            return out
        if not (start >= 0 and stop <= lay.shape[0]):
            raise IndexError(f"rows [{start}, {stop}) outside {lay.key} with {lay.shape[0]} rows")
        c = lay.chunk_rows
        first, last = start // c, (stop - 1) // c
        if lay.shard_rows is None:
            for k in range(first, last + 1):
                self._decode_chunk(self._get(lay.chunk_key(k)), k, start, stop, out)
            return out
        per_shard = lay.shard_rows // c
        k = first
        while k <= last:
            shard = k // per_shard
            k_end = min(last, (shard + 1) * per_shard - 1)
            self._read_shard_run(shard, k, k_end, start, stop, out)
            k = k_end + 1
        return out

    def _read_shard_run(self, shard: int, k0: int, k1: int, start: int, stop: int, out: np.ndarray) -> None:
        per_shard = self.layout.shard_rows // self.layout.chunk_rows  # type: ignore[operator]
        idx = self.shard_index(shard)[k0 - shard * per_shard: k1 - shard * per_shard + 1]
        if (idx[:, 0] == _EMPTY).any():
            raise self._corrupt(f"shard {self.layout.chunk_key(shard)} lacks chunks that the commit record counts")
        lo, hi = int(idx[:, 0].min()), int((idx[:, 0] + idx[:, 1]).max())
        blob = _scratch_bytes(hi - lo)
        try:
            got = self.storage.read_into(self.layout.chunk_key(shard), lo, blob)
        except FileNotFoundError:
            raise self._corrupt(f"shard {self.layout.chunk_key(shard)} is missing") from None
        if got != hi - lo:
            raise self._corrupt(f"shard {self.layout.chunk_key(shard)} is truncated")
        for i, k in enumerate(range(k0, k1 + 1)):
            off, n = int(idx[i, 0]) - lo, int(idx[i, 1])
            self._decode_chunk(blob[off:off + n], k, start, stop, out)

    def _decode_chunk(self, raw: bytes | memoryview, k: int, start: int, stop: int, out: np.ndarray) -> None:
        c = self.layout.chunk_rows
        c0, c1 = k * c, (k + 1) * c
        a, b = max(c0, start), min(c1, stop)
        try:
            if a == c0 and b == c1:  # whole chunk: decode in place
                self.layout.decoder.decode_into(raw, out[a - start:b - start])
                return
            tmp = _scratch_array((c, *self.layout.row_shape), self.layout.dtype)
            self.layout.decoder.decode_into(raw, tmp)
        except ChecksumError as err:
            raise self._corrupt(f"chunk {k}: {err}") from None
        out[a - start:b - start] = tmp[a - c0:b - c0]


class PartReader:
    """Reads samples of one committed part; the small arrays are loaded once and kept."""

    def __init__(self, storage: Storage, part: PartInfo):
        self.storage, self.part = storage, part
        self.layouts = layouts_for(part)
        self.readers = {name: ArrayReader(storage, lay, part.key) for name, lay in self.layouts.items()}
        self._small: dict[str, np.ndarray] = {}

    def small(self, name: str) -> np.ndarray:
        arr = self._small.get(name)
        if arr is None:
            arr = self.readers[name].read(0, self.layouts[name].shape[0])
            self._small[name] = arr
        return arr

    def read_tokens(self, start: int, stop: int) -> torch.Tensor:
        """Features of tokens ``[start, stop)`` of this part as bf16 ``[stop-start, n*H]``."""
        q = self.readers["features"].read(start, stop)
        if self.part.codec == "fp8-e4m3":
            s = self.readers["scales"].read(start, stop)
            return dequantize_fp8(torch.from_numpy(q), torch.from_numpy(s))
        return u16_to_bf16(q)

    def read_rows(self, rows: Sequence[int]) -> list[Sample]:
        """Samples at positions ``rows`` of this part, in that order."""
        offsets = self.small("offsets")
        ids, input_ids, mask = self.small("sample_ids"), self.small("input_ids"), self.small("loss_mask")
        argmax = self.small("target_argmax") if self.part.has_target_argmax else None
        out = []
        for r in rows:
            a, b = int(offsets[r]), int(offsets[r + 1])
            out.append(Sample(
                sample_id=int(ids[r]),
                input_ids=torch.from_numpy(input_ids[a:b].astype(np.int64)),
                loss_mask=torch.from_numpy(mask[a:b].astype(bool)),
                features=self.read_tokens(a, b),
                target_argmax=None if argmax is None else torch.from_numpy(argmax[a:b].astype(np.int64)),
                bucket=self.part.bucket, part=self.part.name,
            ))
        return out


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
        r = PartReader(self.storage, part)
        with self._lock:
            self._items[part.key] = r
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return r

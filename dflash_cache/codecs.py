"""Storage codecs for the feature array, chosen per cache.

- ``bf16-zstd`` (default, lossless): blosc zstd level 1, byte shuffle, typesize 2, 1 MiB blocks. The
  best measured setting (0.69-0.70 of raw on activations with outlier channels; the low byte of bf16
  is noise, so ~0.69 is the bound).
- ``bf16-lz4`` (lossless, faster decode, larger): blosc lz4, bit shuffle.
- ``bf16-raw`` (lossless, no compression).
- ``fp8-e4m3`` (lossy): one fp32 scale per token per layer (``absmax / 448``), values cast to
  float8-e4m3 in torch (so the quantiser runs on whatever device holds the features), then zstd.

bf16 is stored as ``uint16`` and fp8 as ``uint8`` (zarr has neither type); the array attribute
``logical_dtype`` says what the bits mean. Every chunk carries a crc32c (zarr's ``crc32c`` codec),
so a flipped byte is caught on every read, not only by ``verify``.

Speed: a whole chunk is decoded with ``numcodecs.blosc.decompress`` straight into the caller's memory.
numcodecs releases the GIL and uses a per-call blosc context when called from a non-main thread (the
loader's readers), so readers decode in parallel without any process-wide setting. A partial range (a
sample's first and last chunk) is decoded with blosc's ``blosc_getitem``, which decodes only the blosc
blocks the range overlaps; numcodecs has no public call for it, so it is reached through ctypes in the
blosc library numcodecs links in (:class:`_BloscGetitem`), with the public whole-chunk decode as the
fallback where the symbol is not exported (``DFLASH_CACHE_BLOSC_GETITEM=0`` forces the fallback). The
crc32c comes from the ``crc32c`` package when installed (extra ``fast``), else google-crc32c
(``DFLASH_CACHE_CRC=google`` forces it). ``DFLASH_CACHE_ENCODE_THREADS`` sets the writer's encode threads.
"""

from __future__ import annotations

import base64
import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import google_crc32c
import numcodecs.blosc
import numpy as np
import torch
from zarr.codecs import BloscCodec, Crc32cCodec

from .runtime.switches import env_switch

FP8_MAX = 448.0  # largest finite float8-e4m3fn value


@dataclass(frozen=True)
class CodecInfo:
    name: str
    stored_dtype: str  # numpy dtype of the feature array on disk
    logical_dtype: str
    has_scales: bool


CODEC_INFO = {
    "bf16-zstd": CodecInfo("bf16-zstd", "uint16", "bfloat16", False),
    "bf16-lz4": CodecInfo("bf16-lz4", "uint16", "bfloat16", False),
    "bf16-raw": CodecInfo("bf16-raw", "uint16", "bfloat16", False),
    "fp8-e4m3": CodecInfo("fp8-e4m3", "uint8", "float8_e4m3fn", True),
}


@dataclass(frozen=True)
class BloscParams:
    cname: str
    clevel: int
    shuffle: str  # "noshuffle" | "shuffle" | "bitshuffle"
    blocksize: int

    def zarr_codec(self, typesize: int) -> BloscCodec:
        return BloscCodec(cname=self.cname, clevel=self.clevel, shuffle=self.shuffle, typesize=typesize,
                          blocksize=self.blocksize)


_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
FEATURE_BLOSC: dict[str, BloscParams | None] = {
    "bf16-zstd": BloscParams("zstd", 1, "shuffle", 1 << 20),
    "bf16-lz4": BloscParams("lz4", 5, "bitshuffle", 1 << 20),
    "bf16-raw": None,
    "fp8-e4m3": BloscParams("zstd", 1, "noshuffle", 1 << 20),
}
SMALL_BLOSC = BloscParams("zstd", 3, "shuffle", 0)


def _compressors(params: BloscParams | None, typesize: int) -> list:
    return ([params.zarr_codec(typesize)] if params else []) + [Crc32cCodec()]


def feature_compressors(codec: str) -> list:
    """zarr bytes-to-bytes codecs for the feature array's inner chunks (crc32c last)."""
    if codec not in FEATURE_BLOSC:
        raise ValueError(f"unknown codec {codec!r}; expected one of {list(CODEC_INFO)}")
    return _compressors(FEATURE_BLOSC[codec], 2 if CODEC_INFO[codec].stored_dtype == "uint16" else 1)


def small_compressors(typesize: int | None = None) -> list:
    """Codecs for the small per-token and per-sample arrays (ids, masks, offsets, scales)."""
    p = SMALL_BLOSC
    codec = BloscCodec(cname=p.cname, clevel=p.clevel, shuffle=p.shuffle, blocksize=p.blocksize,
                       typesize=typesize)
    return [codec, Crc32cCodec()]


def encode_chunk(chunk: np.ndarray, params: BloscParams | None) -> bytes:
    """One inner chunk as zarr stores it: ``bytes`` (little endian) -> [blosc] -> crc32c appended."""
    chunk = np.ascontiguousarray(chunk)
    body = chunk.tobytes() if params is None else numcodecs.blosc.compress(
        chunk, params.cname.encode(), params.clevel, _SHUFFLE[params.shuffle], params.blocksize)
    return body + crc32c(np.frombuffer(body, np.uint8)).to_bytes(4, "little")


_encode_pool: ThreadPoolExecutor | None = None
_encode_pool_key: tuple[int, int] = (0, 0)  # (threads, pid) it was made for
_encode_pool_lock = threading.Lock()


def encode_threads() -> int:
    """Threads that encode the inner chunks of a shard in parallel (blosc releases the GIL):
    ``DFLASH_CACHE_ENCODE_THREADS``, default min(4, CPU count). One pool serves every writer."""
    env = env_switch("DFLASH_CACHE_ENCODE_THREADS")
    return max(1, int(env)) if env else max(1, min(4, os.cpu_count() or 1))


def _encode_map(chunks: list[np.ndarray], params: BloscParams | None) -> list[bytes]:
    global _encode_pool, _encode_pool_key
    n = encode_threads()
    if params is None or n <= 1 or len(chunks) <= 1:
        return [encode_chunk(c, params) for c in chunks]
    with _encode_pool_lock:
        if _encode_pool is None or _encode_pool_key != (n, os.getpid()):  # a forked child needs its own
            _encode_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="dflash-encode")
            _encode_pool_key = (n, os.getpid())
        pool = _encode_pool
    return list(pool.map(lambda c: encode_chunk(c, params), chunks))


def encode_shard(rows: np.ndarray, chunk_rows: int, shard_rows: int, params: BloscParams | None) -> bytes:
    """A whole shard object of the zarr sharding codec (inner chunks, then the index + its crc32c).

    ``rows`` holds up to ``shard_rows`` rows; the last inner chunk is padded with zeros (the fill value)
    as zarr does, and inner chunks past the data are marked empty in the index. Inner chunks are
    encoded in parallel threads (:func:`encode_threads`).
    """
    n_inner = shard_rows // chunk_rows
    index = np.full((n_inner, 2), np.iinfo(np.uint64).max, dtype="<u8")
    chunks = []
    for j in range(-(-rows.shape[0] // chunk_rows)):
        part = rows[j * chunk_rows:(j + 1) * chunk_rows]
        if part.shape[0] < chunk_rows:
            pad = np.zeros((chunk_rows, *rows.shape[1:]), dtype=rows.dtype)
            pad[:part.shape[0]] = part
            part = pad
        chunks.append(part)
    pieces, offset = _encode_map(chunks, params), 0
    for j, enc in enumerate(pieces):
        index[j] = (offset, len(enc))
        offset += len(enc)
    idx = index.tobytes()
    pieces.append(idx + crc32c(np.frombuffer(idx, np.uint8)).to_bytes(4, "little"))
    return b"".join(pieces)


# ---- what a commit record keeps of the data --------------------------------------------------
# Each shard's chunk table (stored bytes and crc32c of every inner chunk) and the small per-sample arrays
# are copied into the commit record, so that a reader of an object store needs no request for a shard's
# index or for the index arrays, and each chunk it reads is checked against the record (binding it to the
# part). Both are base64 of little-endian bytes: compact, and exact.

_EMPTY_U64 = np.iinfo(np.uint64).max


def chunk_table(shard_blob: bytes, n_inner: int) -> str:
    """The chunk table of a shard object made by :func:`encode_shard`: ``(stored bytes, crc32c)`` of each
    written inner chunk, in order, as base64 of ``<u8`` pairs."""
    idx = np.frombuffer(shard_blob, dtype="<u8", count=2 * n_inner, offset=len(shard_blob) - 16 * n_inner - 4)
    idx = idx.reshape(n_inner, 2)
    used = idx[idx[:, 0] != _EMPTY_U64]
    out = np.empty((len(used), 2), dtype="<u8")
    for i, (off, n) in enumerate(used.tolist()):
        out[i] = (n, int.from_bytes(shard_blob[off + n - 4:off + n], "little"))
    return base64.b64encode(out.tobytes()).decode("ascii")


def index_from_chunk_table(table: str, n_inner: int) -> tuple[np.ndarray, np.ndarray]:
    """``(shard index [n_inner, 2] <u8, chunk crc32c [m] <u8)`` from a chunk table: the chunks lie one after
    another from byte 0 (as :func:`encode_shard` writes them), the rest of the index is empty. Raises
    ``ValueError`` on a table that cannot be one."""
    raw = base64.b64decode(table.encode("ascii"), validate=True)
    if len(raw) % 16 or len(raw) > 16 * n_inner:
        raise ValueError(f"a chunk table of {len(raw)} bytes for a shard of {n_inner} chunks")
    pairs = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
    index = np.full((n_inner, 2), _EMPTY_U64, dtype="<u8")
    sizes = pairs[:, 0]
    index[:len(pairs), 0] = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.uint64)]) if len(pairs) else []
    index[:len(pairs), 1] = sizes
    return index, pairs[:, 1].copy()


def inline_encode(data: np.ndarray) -> str:
    """A small array's bytes (little endian) as base64, for the commit record."""
    a = np.ascontiguousarray(data)
    return base64.b64encode(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).decode("ascii")


def inline_decode(text: str, dtype: np.dtype, n: int) -> np.ndarray:
    """The array :func:`inline_encode` wrote (``ValueError`` when it does not hold ``n`` items)."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    dt = np.dtype(dtype).newbyteorder("<")
    if len(raw) != n * dt.itemsize:
        raise ValueError(f"{len(raw)} bytes for {n} items of {dt}")
    return np.frombuffer(raw, dtype=dt).astype(np.dtype(dtype))


# ---- bf16 <-> uint16 ---------------------------------------------------------------------------


def bf16_to_u16(x: torch.Tensor) -> np.ndarray:
    """[T, D] any float tensor -> the bf16 bit pattern as a uint16 numpy array (on the CPU)."""
    return x.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def u16_to_bf16(a: np.ndarray) -> torch.Tensor:
    """uint16 bit patterns -> a bf16 tensor sharing memory with ``a``."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


# ---- fp8 e4m3 with one scale per token per layer ------------------------------------------------


def quantize_fp8(x: torch.Tensor, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, n*H] -> (uint8 [T, n*H] e4m3 bits, float32 [T, n] scales). Runs on ``x``'s device."""
    t, d = x.shape
    xf = x.detach().float().reshape(t, n_layers, d // n_layers)  # [T, n, H]
    scale = xf.abs().amax(dim=-1) / FP8_MAX  # [T, n]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [T, n, H]
    return q.reshape(t, d).view(torch.uint8), scale


_FP8_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # e4m3 bits -> value


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: int = 256,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """(uint8 [T, n*H], float32 [T, n]) -> bf16 [T, n*H], in token blocks that stay in cache.
    Writes into ``out`` (bf16 [T, n*H]) when given."""
    t, d = q.shape
    n = scale.shape[1]
    if out is None:
        out = torch.empty(t, d, dtype=torch.bfloat16)
    qn, sn = q.numpy(), scale.numpy()
    for a in range(0, t, block):
        b = min(t, a + block)
        xf = _FP8_LUT[qn[a:b]].reshape(b - a, n, d // n) * sn[a:b, :, None]  # [L, n, H] float32
        out[a:b] = torch.from_numpy(xf.reshape(b - a, d))
    return out


# ---- direct chunk decoding (the reader's hot path) ----------------------------------------------


_BLOSC_HEADER = 16
_scratch = threading.local()


class _BloscGetitem:
    """``blosc_getitem(src, start item, n items, dest) -> bytes or < 0`` of the blosc library inside numcodecs,
    through ctypes (the GIL is released during the call). Kept, against the rule of public APIs only, for a
    measured reason: with the public whole-chunk decode for partial ranges instead, the streaming loader
    delivers 0.74x the tokens/s on bf16-zstd (1 reader: 19.0k [17.5-19.0k] vs 25.6k [24.8-26.3k] tok/s;
    2 readers: 40.2k vs 54.4k; bench/bench_loader.py with DFLASH_CACHE_BLOSC_GETITEM=0 vs unset, 3
    interleaved rounds, load average 0.8-1.9; docs/performance.md), because a sample's first and last chunks
    are then decoded whole (1 MiB blosc blocks, chunks of many MiB)."""

    def __init__(self, path: str):
        fn = ctypes.CDLL(path).blosc_getitem
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self.fn = fn

    def __call__(self, body: np.ndarray, start_item: int, n_items: int, dest: np.ndarray) -> int:
        return self.fn(body.ctypes.data, start_item, n_items, dest.ctypes.data)


def _load_getitem() -> _BloscGetitem | None:
    if env_switch("DFLASH_CACHE_BLOSC_GETITEM", "1") == "0":
        return None
    try:
        return _BloscGetitem(numcodecs.blosc.__file__)
    except (OSError, AttributeError):  # another numcodecs build that does not export the symbol
        return None


BLOSC_GETITEM = _load_getitem()


def scratch_buffer(name: str, n: int) -> np.ndarray:
    """A per-thread reusable uint8 buffer of ``n`` bytes (grown, never shrunk): decoding into fresh memory
    page-faults every time."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.nbytes < n:
        buf = np.empty(max(n, 1 << 20), dtype=np.uint8)
        setattr(_scratch, name, buf)
    return buf[:n]


def blosc_header(body: np.ndarray) -> tuple[int, int, int]:
    """(decoded bytes, encoded bytes, typesize) from a blosc chunk's 16-byte header."""
    if body.nbytes < _BLOSC_HEADER:
        raise ChecksumError(f"chunk is {body.nbytes} bytes, shorter than a blosc header")
    head = body[:_BLOSC_HEADER]
    return (int.from_bytes(head[4:8].tobytes(), "little"), int.from_bytes(head[12:16].tobytes(), "little"),
            int(head[3]))


@dataclass(frozen=True)
class ChunkDecoder:
    """Decodes one stored chunk given the array's codec chain: ``bytes`` -> [blosc] -> [crc32c]."""

    blosc: bool
    crc: bool

    def payload(self, raw: bytes | memoryview | np.ndarray) -> np.ndarray:
        """Check the crc32c (raises :class:`ChecksumError`) and return the encoded bytes (uint8, no copy)."""
        mv = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
        if not self.crc:
            return mv
        if mv.nbytes < 4:
            raise ChecksumError(f"chunk is {mv.nbytes} bytes, too short to hold its checksum")
        body, stored = mv[:-4], int.from_bytes(mv[-4:].tobytes(), "little")
        if crc32c(body) != stored:
            raise ChecksumError("chunk checksum mismatch (stored crc32c differs from the data)")
        return body

    def decode_range_into(self, raw: bytes | memoryview | np.ndarray, dest: np.ndarray, start: int,
                          chunk_nbytes: int) -> None:
        """Decode bytes ``[start, start + dest.nbytes)`` of a chunk that decodes to ``chunk_nbytes`` bytes
        into ``dest`` (C-contiguous uint8)."""
        body = self.payload(raw)
        n = dest.nbytes
        if not 0 <= start <= start + n <= chunk_nbytes:
            raise ValueError(f"byte range [{start}, {start + n}) outside a chunk of {chunk_nbytes} bytes")
        if not self.blosc:
            if body.nbytes != chunk_nbytes:
                raise ChecksumError(f"chunk holds {body.nbytes} bytes, expected {chunk_nbytes}")
            dest[:] = body[start:start + n]
            return
        nbytes, cbytes, typesize = blosc_header(body)
        if nbytes != chunk_nbytes or cbytes != body.nbytes or typesize < 1:
            raise ChecksumError(f"chunk header says {nbytes} bytes decoded from {cbytes} (typesize {typesize}); "
                                f"expected {chunk_nbytes} from {body.nbytes}")
        if n == 0:
            return
        if n != chunk_nbytes and BLOSC_GETITEM is not None and not (start % typesize or n % typesize):
            got = BLOSC_GETITEM(body, start // typesize, n // typesize, dest)
            if got != n:
                raise ChecksumError(f"chunk fails to decompress (blosc returned {got}, expected {n})")
            return
        whole = dest if n == chunk_nbytes else scratch_buffer("decoded", chunk_nbytes)
        try:
            numcodecs.blosc.decompress(body, whole)
        except (RuntimeError, ValueError) as err:
            raise ChecksumError(f"chunk fails to decompress ({err})") from None
        if whole is not dest:
            dest[:] = whole[start:start + n]


class ChecksumError(ValueError):
    """A stored chunk is not what was written (caught and re-raised as CacheCorruptError)."""


def _crc_google(data: np.ndarray, value: int) -> int:
    return google_crc32c.extend(value, data)


def _load_crc() -> tuple[str, Callable[[np.ndarray, int], int]]:
    """The fastest crc32c at hand: the ``crc32c`` package (SSE4.2/ARMv8, releases the GIL) when installed
    (the ``fast`` extra), else ``google-crc32c``. Both compute the same Castagnoli CRC."""
    if env_switch("DFLASH_CACHE_CRC", "") != "google":
        try:
            import crc32c as _fast

            if getattr(_fast, "hardware_based", False):
                return "crc32c", lambda data, value: _fast.crc32c(data, value)
        except ImportError:
            pass
    return "google-crc32c", _crc_google


CRC_IMPL, _crc = _load_crc()


def crc32c(data: bytes | memoryview | np.ndarray, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from ``value``."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    elif isinstance(data, memoryview):
        data = np.frombuffer(data, dtype=np.uint8)  # the C extensions take arrays and bytes, not views
    return _crc(data, value)

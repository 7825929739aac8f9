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
"""

from __future__ import annotations

from dataclasses import dataclass

import numcodecs.blosc
import numpy as np
import torch
from zarr.codecs import BloscCodec, Crc32cCodec

FP8_MAX = 448.0  # largest finite float8-e4m3fn value

numcodecs.blosc.use_threads = False  # decode on the calling thread; parallelism comes from reader threads


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


def encode_shard(rows: np.ndarray, chunk_rows: int, shard_rows: int, params: BloscParams | None) -> bytes:
    """A whole shard object of the zarr sharding codec (inner chunks, then the index + its crc32c).

    ``rows`` holds up to ``shard_rows`` rows; the last inner chunk is padded with zeros (the fill value)
    as zarr does, and inner chunks past the data are marked empty in the index.
    """
    n_inner = shard_rows // chunk_rows
    index = np.full((n_inner, 2), np.iinfo(np.uint64).max, dtype="<u8")
    pieces, offset = [], 0
    for j in range(-(-rows.shape[0] // chunk_rows)):
        part = rows[j * chunk_rows:(j + 1) * chunk_rows]
        if part.shape[0] < chunk_rows:
            pad = np.zeros((chunk_rows, *rows.shape[1:]), dtype=rows.dtype)
            pad[:part.shape[0]] = part
            part = pad
        enc = encode_chunk(part, params)
        index[j] = (offset, len(enc))
        pieces.append(enc)
        offset += len(enc)
    idx = index.tobytes()
    pieces.append(idx + crc32c(np.frombuffer(idx, np.uint8)).to_bytes(4, "little"))
    return b"".join(pieces)


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


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: int = 256) -> torch.Tensor:
    """(uint8 [T, n*H], float32 [T, n]) -> bf16 [T, n*H], in token blocks that stay in cache."""
    t, d = q.shape
    n = scale.shape[1]
    out = torch.empty(t, d, dtype=torch.bfloat16)
    qn, sn = q.numpy(), scale.numpy()
    for a in range(0, t, block):
        b = min(t, a + block)
        xf = _FP8_LUT[qn[a:b]].reshape(b - a, n, d // n) * sn[a:b, :, None]  # [L, n, H] float32
        out[a:b] = torch.from_numpy(xf.reshape(b - a, d))
    return out


# ---- direct chunk decoding (the reader's hot path) ----------------------------------------------


@dataclass(frozen=True)
class ChunkDecoder:
    """Decodes one stored chunk given the array's codec chain: ``bytes`` -> [blosc] -> [crc32c]."""

    blosc: bool
    crc: bool

    @classmethod
    def from_codecs(cls, codecs: list[dict]) -> ChunkDecoder:
        names = [c["name"] for c in codecs]
        unknown = set(names) - {"bytes", "blosc", "crc32c"}
        if unknown:
            raise ValueError(f"unsupported codecs {sorted(unknown)} in the array metadata")
        return cls(blosc="blosc" in names, crc="crc32c" in names)

    def payload(self, raw: bytes | memoryview) -> memoryview:
        """Check the crc32c (raises :class:`ChecksumError`) and return the encoded bytes."""
        mv = memoryview(raw)
        if not self.crc:
            return mv
        if len(mv) < 4:
            raise ChecksumError(f"chunk is {len(mv)} bytes, too short to hold its checksum")
        body, stored = mv[:-4], int.from_bytes(mv[-4:], "little")
        if crc32c(body) != stored:
            raise ChecksumError("chunk checksum mismatch (stored crc32c differs from the data)")
        return body

    def decode_into(self, raw: bytes | memoryview, out: np.ndarray) -> None:
        """Decode into a C-contiguous array of exactly the chunk's size."""
        body = self.payload(raw)
        dest = out.reshape(-1).view(np.uint8)
        if self.blosc:
            try:
                numcodecs.blosc.decompress(body, dest)
            except (RuntimeError, ValueError) as err:
                raise ChecksumError(f"chunk fails to decompress ({err})") from None
        else:
            if len(body) != dest.nbytes:
                raise ChecksumError(f"chunk holds {len(body)} bytes, expected {dest.nbytes}")
            dest[:] = np.frombuffer(body, dtype=np.uint8)


class ChecksumError(ValueError):
    """A stored chunk is not what was written (caught and re-raised as CacheCorruptError)."""


def crc32c(data: bytes | memoryview | np.ndarray, value: int = 0) -> int:
    import google_crc32c

    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    elif isinstance(data, memoryview):
        data = np.frombuffer(data, dtype=np.uint8)  # the C extension takes arrays and bytes, not views
    return google_crc32c.extend(value, data)

"""Round trips through the cache: bitwise for bf16, within the documented error for fp8."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from dflash_cache import CacheSpec, TeacherInfo, codecs, create_cache, open_cache
from dflash_cache.errors import CacheCorruptError, CacheError, DataError, SpecMismatchError
from dflash_cache.reader import PartReader
from dflash_cache.synthetic import synthetic_features

H, N_LAYERS = 32, 2


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_FSYNC", "0")  # durability is exercised in test_cache_integrity


def _spec(codec: str = "bf16-zstd", **kw) -> CacheSpec:
    base = dict(teacher=TeacherInfo("tiny", None, 4, H, 100, "bfloat16"), target_layer_ids=[1, 2],
                tokenizer_hash="tok", max_length=300, codec=codec, bucket_edges=[16, 64], dataset_fingerprint="d")
    base.update(kw)
    return CacheSpec(**base)


def _samples(n: int, seed: int = 0) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(torch.randint(17, 64, (1,), generator=g))  # all in bucket 1
        ids = torch.randint(0, 100, (t,), generator=g)
        mask = torch.rand(t, generator=g) > 0.3
        out.append((1000 + i, ids, mask, synthetic_features(t, N_LAYERS, H, g)))
    return out


def _write(cache, samples, name="p0", argmax=False):
    with cache.part_writer(1, name, meta={"unit": name}) as w:
        for sid, ids, mask, feats in samples:
            w.add(sid, ids, mask, feats, target_argmax=ids.flip(0) if argmax else None)
    return w


@pytest.mark.parametrize("url_kind", ["local", "memory"])
@pytest.mark.parametrize("codec", ["bf16-zstd", "bf16-lz4", "bf16-raw"])
def test_bf16_round_trip_is_bitwise(tmp_path, url_kind, codec):
    url = str(tmp_path / "c") if url_kind == "local" else f"memory://rt-{codec}-{tmp_path.name}"
    cache = create_cache(url, _spec(codec), chunk_tokens=16, shard_tokens=64)
    samples = _samples(12)
    _write(cache, samples, argmax=True)
    cache = open_cache(url)
    (part,) = cache.parts()
    assert (part.n_samples, part.n_tokens) == (12, sum(s[1].shape[0] for s in samples))
    assert part.meta == {"unit": "p0"} and part.has_target_argmax
    want_order = [s[0] for s in samples][::-1]
    got = cache.read_samples(want_order)
    assert [s.sample_id for s in got] == want_order
    by_id = {s[0]: s for s in samples}
    for s in got:
        _, ids, mask, feats = by_id[s.sample_id]
        assert s.features.dtype == torch.bfloat16
        assert torch.equal(s.features.view(torch.int16), feats.view(torch.int16))
        assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask)
        assert torch.equal(s.target_argmax, ids.flip(0))
        assert (s.bucket, s.part) == (1, "p0")


def test_direct_reader_matches_zarr(tmp_path):
    cache = create_cache(str(tmp_path / "c"), _spec(), chunk_tokens=16, shard_tokens=64)
    _write(cache, _samples(10))
    part = cache.parts()[0]
    z = zarr.open_array(str(tmp_path / "c" / part.data_key / "features"), mode="r")[:]
    ours = cache.read_tokens(part, 0, part.n_tokens)
    assert np.array_equal(ours.view(torch.int16).numpy().view(np.uint16), z)
    assert torch.equal(cache.read_tokens(part, 5, 77), ours[5:77])


def test_fp8_within_documented_error(tmp_path):
    cache = create_cache(str(tmp_path / "c"), _spec("fp8-e4m3"), chunk_tokens=16, shard_tokens=64)
    samples = _samples(8)
    _write(cache, samples)
    got = {s.sample_id: s for s in open_cache(str(tmp_path / "c")).read_samples([s[0] for s in samples])}
    for sid, _, _, feats in samples:
        x, y = feats.float(), got[sid].features.float()
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)  # [T]
        assert cos.min() >= 0.999
        big = x.abs() > 0.05 * x.abs().amax(dim=-1, keepdim=True)
        rel = ((y - x).abs() / x.abs())[big]
        assert rel.max() <= 0.0625 + 0.008 and rel.mean() <= 0.03


def test_same_spec_reopens_and_other_spec_is_refused(tmp_path):
    url = str(tmp_path / "c")
    create_cache(url, _spec())
    assert create_cache(url, _spec()).spec.fingerprint == _spec().fingerprint
    with pytest.raises(SpecMismatchError) as err:
        create_cache(url, _spec(codec="fp8-e4m3", target_layer_ids=[0, 1]))
    assert err.value.fields == ["codec", "target_layer_ids"]
    assert "codec: cache has 'bf16-zstd', asked for 'fp8-e4m3'" in str(err.value)


def test_spec_diff_names_nested_fields():
    other = _spec(teacher=TeacherInfo("tiny", "main", 4, H, 100, "bfloat16"))
    assert _spec().diff(other) == ["teacher.revision"]
    assert _spec().fingerprint != other.fingerprint
    assert _spec().feature_dim == N_LAYERS * H


def test_buckets_route_by_length(tmp_path):
    cache = create_cache(str(tmp_path / "c"), _spec())
    assert [cache.bucket_of(t) for t in (1, 16, 17, 64, 65, 300)] == [0, 0, 1, 1, 2, 2]
    assert cache.bucket_bounds(0) == (0, 16) and cache.bucket_bounds(2) == (64, 300)
    with pytest.raises(DataError, match="max_length 300"):
        cache.bucket_of(301)


def test_writer_rejects_bad_samples(tmp_path):
    cache = create_cache(str(tmp_path / "c"), _spec())
    w = cache.part_writer(1, "p0")
    sid, ids, mask, feats = _samples(1)[0]
    with pytest.raises(DataError, match="belongs in bucket 0"):
        w.add(1, ids[:5], mask[:5], feats[:5])
    with pytest.raises(DataError, match="features must be"):
        w.add(1, ids, mask, feats[:, :10])
    bad = feats.clone()
    bad[3, 4] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        w.add(1, ids, mask, bad)
    w.add(sid, ids, mask, feats)
    with pytest.raises(DataError, match="already added"):
        w.add(sid, ids, mask, feats)
    w.commit()
    with pytest.raises(CacheError, match="already committed"):
        cache.part_writer(1, "p0")


def test_head_and_metadata(tmp_path):
    cache = create_cache(str(tmp_path / "c"), _spec())
    emb, head = torch.randn(100, H), torch.randn(100, H)
    cache.save_head(emb, head)
    cache.save_head(emb, head)  # identical: a no-op
    with pytest.raises(CacheError, match="different head"):
        cache.save_head(emb * 2, None)
    e, h = open_cache(str(tmp_path / "c")).load_head()
    assert torch.equal(e, emb) and torch.equal(h, head)
    cache.write_metadata("resolved_config", {"a": [1, 2]})
    assert cache.read_metadata("resolved_config") == {"a": [1, 2]}


def test_tied_head(tmp_path):
    cache = create_cache(f"memory://tied-{tmp_path.name}", _spec())
    emb = torch.randn(100, H).to(torch.bfloat16)
    cache.save_head(emb)
    e, h = cache.load_head()
    assert torch.equal(e, emb) and torch.equal(h, emb)


def test_add_batch_equals_add(tmp_path):
    samples = _samples(6)
    a = create_cache(str(tmp_path / "a"), _spec(), chunk_tokens=16, shard_tokens=64)
    _write(a, samples)
    b = create_cache(str(tmp_path / "b"), _spec(), chunk_tokens=16, shard_tokens=64)
    with b.part_writer(1, "p0", meta={"unit": "p0"}) as w:
        w.add_batch([s[0] for s in samples], [s[1].shape[0] for s in samples], torch.cat([s[1] for s in samples]),
                    torch.cat([s[2] for s in samples]), torch.cat([s[3] for s in samples]))
        with pytest.raises(DataError, match="unique"):
            w.add_batch([samples[0][0]], [samples[0][1].shape[0]], samples[0][1], samples[0][2], samples[0][3])
    assert a.parts()[0].arrays == b.parts()[0].arrays  # same shapes, same checksums, same bytes on disk


# ---- reads into caller buffers, partial-chunk decoding, crc implementations --------------------------


def _spans(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """Token ranges that start/stop on and off chunk edges, inside one chunk and across several."""
    out = [(0, n_tokens), (0, 1), (n_tokens - 1, n_tokens), (chunk, 2 * chunk), (3, chunk - 2),
           (chunk - 1, chunk + 1), (5, n_tokens - 7)]
    return [(a, b) for a, b in out if 0 <= a < b <= n_tokens]


@pytest.mark.parametrize("url_kind", ["local", "memory"])
@pytest.mark.parametrize("codec", ["bf16-zstd", "bf16-lz4", "bf16-raw", "fp8-e4m3"])
def test_reads_into_buffers_equal_plain_reads(tmp_path, url_kind, codec):
    url = str(tmp_path / "c") if url_kind == "local" else f"memory://into-{codec}-{tmp_path.name}"
    cache = create_cache(url, _spec(codec), chunk_tokens=16, shard_tokens=64)
    _write(cache, _samples(10))
    (part,) = cache.parts()
    whole = cache.read_tokens(part, 0, part.n_tokens)
    reader = PartReader(cache.storage, part)
    for a, b in _spans(part.n_tokens, 16):
        out = torch.full((b - a, whole.shape[1]), 7.0, dtype=torch.bfloat16)
        assert reader.read_tokens_into(a, b, out) is out
        assert torch.equal(out.view(torch.int16), whole[a:b].view(torch.int16)), (a, b)
    rows = [7, 0, 3]
    plain = cache.read_rows(part, rows)
    batch = torch.zeros(3, 70, whole.shape[1], dtype=torch.bfloat16)  # slices of one buffer, like the loader's
    outs = [batch[i, :s.features.shape[0]] for i, s in enumerate(plain)]
    got = reader.read_rows(rows, out=outs)
    for p, g, o in zip(plain, got, outs, strict=True):
        assert g.features is o and g.sample_id == p.sample_id
        assert torch.equal(g.features.view(torch.int16), p.features.view(torch.int16))
        assert torch.equal(g.input_ids, p.input_ids) and torch.equal(g.loss_mask, p.loss_mask)


def test_read_into_refuses_a_wrong_buffer(tmp_path):
    cache = create_cache(str(tmp_path / "c"), _spec(), chunk_tokens=16, shard_tokens=64)
    _write(cache, _samples(3))
    reader = PartReader(cache.storage, cache.parts()[0])
    d = cache.spec.feature_dim
    for bad in (torch.zeros(5, d), torch.zeros(4, d, dtype=torch.bfloat16), torch.zeros(d, 5, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="out must be"):
            reader.read_tokens_into(0, 5, bad)
    with pytest.raises(ValueError, match="3 rows"):
        reader.read_rows([0, 1, 2], out=[torch.zeros(1, d, dtype=torch.bfloat16)])


def test_partial_chunks_spanning_blosc_blocks_decode_exactly(tmp_path):
    """Chunks of 2 MiB hold two 1 MiB blosc blocks: any range of tokens (within a chunk, across chunks, a
    whole chunk) decodes to exactly what zarr's full read gives."""
    spec = _spec(teacher=TeacherInfo("wide", None, 4, 1024, 100, "bfloat16"))  # 2 layers x 1024: 4 KiB/token
    cache = create_cache(str(tmp_path / "c"), spec, chunk_tokens=512, shard_tokens=1024)
    g = torch.Generator().manual_seed(1)
    with cache.part_writer(2, "p") as w:
        for i, t in enumerate((300, 290, 280, 270)):
            w.add(i, torch.zeros(t, dtype=torch.long), torch.ones(t, dtype=torch.bool),
                  synthetic_features(t, 2, 1024, g))
    (part,) = cache.parts()
    z = zarr.open_array(str(tmp_path / "c" / part.data_key / "features"), mode="r")[:]
    reader = PartReader(cache.storage, part)
    for a, b in _spans(part.n_tokens, 512) + [(250, 262), (256, 512), (200, 700)]:
        got = reader.read_tokens(a, b).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, z[a:b]), (a, b)


def test_crc32c_implementations_agree():
    import google_crc32c

    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    want = google_crc32c.value(data.tobytes())
    assert codecs.crc32c(data) == want
    assert codecs.crc32c(data[1000:], codecs.crc32c(data[:1000])) == want
    assert codecs.crc32c(memoryview(data.tobytes())) == want
    assert codecs._crc_google(data, 0) == want


def test_flipped_byte_in_an_uncompressed_chunk_is_caught(tmp_path):
    cache = create_cache(str(tmp_path / "c"), _spec("bf16-raw"), chunk_tokens=16, shard_tokens=64)
    samples = _samples(4)
    _write(cache, samples)
    (part,) = cache.parts()
    shard = tmp_path / "c" / part.data_key / "features" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[16 * 2 * H * N_LAYERS + 5] ^= 0x01  # in chunk 1, token 0
    shard.write_bytes(bytes(data))
    reader = PartReader(cache.storage, part)
    reader.read_tokens_into(0, 16, torch.empty(16, 2 * H, dtype=torch.bfloat16))  # chunk 0 is intact
    with pytest.raises(CacheCorruptError, match="checksum"):
        reader.read_tokens_into(20, 24, torch.empty(4, 2 * H, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_writer_finiteness_check_catches_every_non_finite_value(dtype):
    from dflash_cache.writer import all_finite

    x = torch.randn(40, 64).to(dtype)
    assert all_finite(x) and all_finite(x[:0]) and all_finite(torch.zeros(3, dtype=torch.int32))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[17, 33] = bad
        assert not all_finite(y), bad


def test_cache_read_rows_into_destinations_is_bitwise(tmp_path):
    import torch

    from dflash_cache import open_cache
    from dflash_cache.synthetic import make_synthetic_cache

    url = str(tmp_path / "c")
    make_synthetic_cache(url, n_samples=12, hidden_size=32, num_layers=6, target_layer_ids=(1, 2, 3),
                         vocab_size=64, max_length=256, median_length=60, seed=3)
    cache = open_cache(url)
    part = cache.parts()[0]
    rows = list(range(part.n_samples))[::-1]
    plain = cache.read_rows(part, rows)
    outs = [torch.empty_like(s.features) for s in plain]
    into = cache.read_rows(part, rows, out=outs)
    for a, b, o in zip(plain, into, outs, strict=True):
        assert a.sample_id == b.sample_id
        assert torch.equal(a.features.view(torch.int16), o.view(torch.int16))
        assert torch.equal(a.features.view(torch.int16), b.features.view(torch.int16))


@pytest.mark.parametrize("codec", ["bf16-zstd", "bf16-lz4", "fp8-e4m3"])
def test_partial_chunk_ranges_decode_the_same_by_blocks_and_whole(codec, monkeypatch):
    """A partial range of a chunk decodes through blosc_getitem (only the blosc blocks it overlaps) or, as
    the fallback, by decoding the whole chunk: both give exactly the stored bytes, for ranges within one
    blosc block, across block boundaries, and at the chunk's ends."""
    if codecs.BLOSC_GETITEM is None:
        pytest.skip("this numcodecs build does not export blosc_getitem")
    dtype = np.uint16 if codecs.CODEC_INFO[codec].stored_dtype == "uint16" else np.uint8
    rng = np.random.default_rng(0)
    size = np.dtype(dtype).itemsize
    # 1.5 MiB: more than one 1 MiB blosc block
    chunk = rng.integers(0, 1 << (10 if size == 2 else 6), size=(96, 16384 // size), dtype=dtype)
    raw = codecs.encode_chunk(chunk, codecs.FEATURE_BLOSC[codec])
    flat = chunk.reshape(-1).view(np.uint8)
    ranges = [(0, 16 * size), (flat.nbytes - 64 * size, 64 * size), ((1 << 20) - 10 * size, 20 * size),
              (3 * 8192 * size, 40 * 8192 * size), (size, flat.nbytes - 2 * size)]
    decoder = codecs.ChunkDecoder(blosc=True, crc=True)
    for getitem in (codecs.BLOSC_GETITEM, None):
        monkeypatch.setattr(codecs, "BLOSC_GETITEM", getitem)
        for start, n in ranges:
            dest = np.empty(n, np.uint8)
            decoder.decode_range_into(raw, dest, start, flat.nbytes)
            assert np.array_equal(dest, flat[start:start + n]), (getitem, start, n)

"""The feature cache: create/open, the head, JSON metadata, parts, the index, reads and gc."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .buckets import bucket_bounds, bucket_of
from .errors import (
    CacheCorruptError,
    CacheError,
    CacheNotFoundError,
    NotACacheError,
    SampleNotFoundError,
    SpecMismatchError,
)
from .head import HEAD_KEY, decode_head, encode_head
from .index import CacheIndex, build_index
from .parts import COMMIT, LEASE, PartInfo, check_part_name, part_key
from .reader import PartReaderCache, Sample
from .spec import ATTR_KEY, FORMAT_VERSION, CacheSpec, describe_diff
from .storage import Storage, make_storage
from .writer import PartWriter

log = logging.getLogger(__name__)


class FeatureCache:
    """An opened cache. Use :func:`create_cache` or :func:`open_cache` to get one."""

    def __init__(self, storage: Storage, spec: CacheSpec, chunk_tokens: int, shard_tokens: int):
        self.storage, self.spec = storage, spec
        self.chunk_tokens, self.shard_tokens = chunk_tokens, shard_tokens
        self._index: CacheIndex | None = None
        self._readers = PartReaderCache(storage)

    @property
    def url(self) -> str:
        return self.storage.url

    def __repr__(self) -> str:
        return f"FeatureCache({self.url!r}, codec={self.spec.codec!r}, fingerprint={self.spec.fingerprint})"

    # -- buckets ----------------------------------------------------------------------------------

    def bucket_of(self, length: int) -> int:
        return bucket_of(self.spec.bucket_edges, self.spec.max_length, length)

    def bucket_bounds(self, b: int) -> tuple[int, int]:
        return bucket_bounds(self.spec.bucket_edges, self.spec.max_length, b)

    # -- head and metadata ------------------------------------------------------------------------

    def save_head(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Store the frozen embedding ``[V, H]`` and lm_head ``[V, H]`` (None = tied) once."""
        raw = encode_head(self.spec, embed_tokens, lm_head)
        if self.storage.exists(HEAD_KEY):
            if self.storage.get(HEAD_KEY) == raw:
                return
            raise CacheError(f"{self.url} already holds a different {HEAD_KEY}; the head is written once "
                             "(a different teacher needs a new cache)")
        self.storage.put(HEAD_KEY, raw, durable=True)

    def has_head(self) -> bool:
        return self.storage.exists(HEAD_KEY)

    def load_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embed_tokens [V, H], lm_head [V, H])``; lm_head is the embedding when tied."""
        if not self.storage.exists(HEAD_KEY):
            raise CacheError(f"{self.url} has no {HEAD_KEY}: extraction stores the teacher's embedding and "
                             "lm_head with cache.save_head(); re-run extraction's head step")
        return decode_head(self.storage.get(HEAD_KEY))

    def write_metadata(self, name: str, obj: Any) -> None:
        """Store a JSON document ``meta/<name>.json`` (one writer per name)."""
        check_part_name(name)
        self.storage.put(f"meta/{name}.json", json.dumps(obj, indent=1, sort_keys=True).encode(), durable=True)

    def read_metadata(self, name: str) -> Any:
        check_part_name(name)
        try:
            return json.loads(self.storage.get(f"meta/{name}.json"))
        except FileNotFoundError:
            raise CacheError(f"{self.url} has no metadata document {name!r} (meta/{name}.json)") from None

    # -- parts ------------------------------------------------------------------------------------

    def part_writer(self, bucket: int, name: str, meta: dict[str, Any] | None = None) -> PartWriter:
        """A writer that owns part ``buckets/<bucket>/<name>/`` (names unique per bucket)."""
        return PartWriter(self, bucket, name, meta)

    def _part_dirs(self) -> list[tuple[int, str]]:
        out = []
        for b in range(self.spec.n_buckets):
            for name in self.storage.list_dir(f"buckets/{b}"):
                if name != "zarr.json" and not name.startswith("."):
                    out.append((b, name))
        return out

    def parts(self) -> list[PartInfo]:
        """Committed parts only, ordered by (bucket, name)."""
        out = []
        for b, name in self._part_dirs():
            key = part_key(b, name)
            try:
                raw = self.storage.get(f"{key}/{COMMIT}")
            except FileNotFoundError:
                continue
            info = PartInfo.from_record(raw, key)
            if (info.bucket, info.name) != (b, name):
                raise CacheCorruptError(f"part {key}: its commit record names {part_key(info.bucket, info.name)}; "
                                        "a part directory was moved or copied", part=key, array=COMMIT)
            out.append(info)
        return out

    def uncommitted(self) -> list[str]:
        """Keys (``buckets/<b>/<name>``) of part directories without a commit record."""
        return [part_key(b, n) for b, n in self._part_dirs() if not self.storage.exists(f"{part_key(b, n)}/{COMMIT}")]

    def gc(self, min_age_s: float = 3600.0, dry_run: bool = False) -> list[str]:
        """Remove uncommitted leftovers whose writer is gone. Returns the keys removed (or that would be).

        A leftover is kept when its writer is a live process on this host, or (other hosts) when its
        lease is younger than ``min_age_s``.
        """
        removed = []
        for key in self.uncommitted():
            if _writer_alive(self.storage, key, min_age_s):
                log.info("keeping %s: its writer is still running", key)
                continue
            if not dry_run:
                self.storage.remove_tree(key)
            removed.append(key)
        return removed

    # -- index and reads --------------------------------------------------------------------------

    def index(self) -> CacheIndex:
        """A fresh index of every committed sample, from the small arrays only."""
        self._index = build_index(self.storage, self.parts())
        return self._index

    def _positions(self, sample_ids: Sequence[int]) -> tuple[CacheIndex, np.ndarray]:
        idx = self._index if self._index is not None else self.index()
        try:
            return idx, idx.positions(sample_ids)
        except SampleNotFoundError:
            idx = self.index()  # parts may have been committed since
            return idx, idx.positions(sample_ids)

    def read_sample(self, sample_id: int) -> Sample:
        return self.read_samples([sample_id])[0]

    def read_samples(self, sample_ids: Sequence[int]) -> list[Sample]:
        """Samples in the order asked; reads are grouped by part internally."""
        idx, pos = self._positions(sample_ids)
        out: list[Sample | None] = [None] * len(pos)
        by_part: dict[int, list[int]] = {}
        for i, p in enumerate(pos.tolist()):
            by_part.setdefault(int(idx.part[p]), []).append(i)
        for part_i, where in by_part.items():
            rows = [int(idx.row[pos[i]]) for i in where]
            for i, s in zip(where, self.read_rows(idx.parts[part_i], rows), strict=True):
                out[i] = s
        return out  # type: ignore[return-value]

    def read_token_ids(self, sample_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(input_ids [T], loss_mask [T])`` of each sample in the order asked, without its features
        (only the parts' small arrays are read)."""
        idx, pos = self._positions(sample_ids)
        out = []
        for p in pos.tolist():
            reader = self._readers.get(idx.parts[int(idx.part[p])])
            a, b = reader.span(int(idx.row[p]))
            out.append((reader.small("input_ids")[a:b].astype(np.int64), reader.small("loss_mask")[a:b].astype(bool)))
        return out

    def read_rows(self, part: PartInfo, rows: Sequence[int], out: Sequence[torch.Tensor] | None = None
                  ) -> list[Sample]:
        """Samples at positions ``rows`` of one part (the loader's batch path); ``out``: one bf16
        ``[len, n*H]`` destination per row to decode the features into (no extra copy)."""
        return self._readers.get(part).read_rows(rows, out=out)

    def read_tokens(self, part: PartInfo, start: int, stop: int) -> torch.Tensor:
        """Features of tokens ``[start, stop)`` of a part (a whole chunk range) as bf16 ``[L, n*H]``."""
        return self._readers.get(part).read_tokens(start, stop)


def _writer_alive(storage: Storage, key: str, min_age_s: float) -> bool:
    try:
        lease = json.loads(storage.get(f"{key}/{LEASE}"))
    except (FileNotFoundError, ValueError):
        return False
    if lease.get("host") == socket.gethostname():
        try:
            os.kill(int(lease["pid"]), 0)
        except (ProcessLookupError, KeyError, ValueError):
            return False
        except PermissionError:
            return True
        return True
    return time.time() - float(lease.get("started_unix", 0)) < min_age_s


# -- create / open ---------------------------------------------------------------------------------


def _root_attrs(storage: Storage) -> dict[str, Any] | None:
    try:
        raw = storage.get("zarr.json")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        raise NotACacheError(f"{storage.url}/zarr.json is not valid JSON: this is not a dflash cache") from None
    attrs = (meta.get("attributes") or {}).get(ATTR_KEY) if isinstance(meta, dict) else None
    if not isinstance(attrs, dict):
        raise NotACacheError(f"{storage.url} is a zarr store but not a dflash cache (no '{ATTR_KEY}' root "
                             "attribute); point at a cache made by dflash-extract")
    return attrs


def _cache_from_attrs(storage: Storage, attrs: dict[str, Any]) -> FeatureCache:
    version = int(attrs.get("format_version", 0))
    if version > FORMAT_VERSION:
        raise CacheError(f"{storage.url} uses cache format {version}, newer than this tool's {FORMAT_VERSION}; "
                         "upgrade dflash-pipeline")
    spec = CacheSpec.from_dict(attrs["spec"])
    if spec.fingerprint != attrs.get("fingerprint"):
        raise CacheCorruptError(f"{storage.url}: the stored fingerprint {attrs.get('fingerprint')} does not match "
                                f"the stored spec ({spec.fingerprint}); the root attributes were edited",
                                array="zarr.json")
    layout = attrs.get("layout", {})
    return FeatureCache(storage, spec, int(layout.get("chunk_tokens", 256)), int(layout.get("shard_tokens", 16384)))


def _group_json(attributes: dict[str, Any]) -> bytes:
    """A zarr v3 group's metadata document (written directly: no overwrite-deletes-the-directory risk)."""
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}, indent=1).encode()


def open_cache(url: str, storage: Storage | None = None) -> FeatureCache:
    """Open an existing cache (local path or fsspec URL)."""
    storage = storage or make_storage(str(url))
    if not storage.root_exists():
        raise CacheNotFoundError(f"no cache at {url}: the path does not exist (check the path, or run "
                                 "dflash-extract to create the cache)")
    attrs = _root_attrs(storage)
    if attrs is None:
        raise NotACacheError(f"{url} exists but is not a dflash cache (no zarr.json at its root)")
    return _cache_from_attrs(storage, attrs)


def create_cache(url: str, spec: CacheSpec, chunk_tokens: int = 256, shard_tokens: int = 16384,
                 storage: Storage | None = None) -> FeatureCache:
    """Create a cache, or open an existing one written with the same spec (else SpecMismatchError)."""
    if chunk_tokens <= 0 or shard_tokens % chunk_tokens:
        raise CacheError(f"shard_tokens ({shard_tokens}) must be a positive multiple of chunk_tokens ({chunk_tokens})")
    storage = storage or make_storage(str(url))
    attrs = _root_attrs(storage) if storage.root_exists() else None
    if attrs is not None:
        cache = _cache_from_attrs(storage, attrs)
        if cache.spec.fingerprint != spec.fingerprint:
            fields = cache.spec.diff(spec)
            raise SpecMismatchError(f"{url} was written with another spec: {describe_diff(cache.spec, spec)}. "
                                    "Use a new cache path, or change the config to match", fields=fields)
        return cache
    if storage.root_exists() and set(storage.list_dir("")) - {"buckets", "zarr.json"}:
        raise NotACacheError(f"{url} is a non-empty directory without a cache in it; choose a new or empty path")
    root = {"format_version": FORMAT_VERSION, "spec": spec.to_dict(), "fingerprint": spec.fingerprint,
            "layout": {"chunk_tokens": chunk_tokens, "shard_tokens": shard_tokens}}
    for b in range(spec.n_buckets):
        lo, hi = bucket_bounds(spec.bucket_edges, spec.max_length, b)
        storage.put(f"buckets/{b}/zarr.json", _group_json({"lo": lo, "hi": hi}))
    storage.put("buckets/zarr.json", _group_json({}))
    storage.put("zarr.json", _group_json({ATTR_KEY: root}), durable=True)  # written last: now it is a cache
    log.info("created cache %s (codec %s, fingerprint %s)", url, spec.codec, spec.fingerprint)
    return FeatureCache(storage, spec, chunk_tokens, shard_tokens)

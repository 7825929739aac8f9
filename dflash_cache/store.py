"""The feature cache: create/open, the head, JSON metadata, parts, the index, reads and gc."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .buckets import bucket_bounds, bucket_of
from .codecs import crc32c
from .errors import (
    CacheCorruptError,
    CacheError,
    CacheNotFoundError,
    NotACacheError,
    SampleNotFoundError,
    SpecMismatchError,
)
from .fence import (
    commit_sealed,
    garbage_of_committed,
    remove_dead_seals,
    remove_garbage_of_committed,
    seal_key,
)
from .head import HEAD_KEY, decode_head, encode_head
from .index import CacheIndex, build_index
from .lease import (
    LEASE_TIMEOUT_S,
    LeaseHeldError,
    PartCommittedError,
    PartLease,
    acquire,
    acquire_committed,
    is_lease_file,
    live_holder,
)
from .parts import COMMIT, PartInfo, check_part_name, part_key
from .reader import PartReaderCache, Sample
from .spec import ATTR_KEY, FORMAT_VERSION, CacheSpec, describe_diff
from .spec import root_attrs as _root_attrs
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
        """Store the frozen embedding ``[V, H]`` and lm_head ``[V, H]`` (None = tied) once, and its
        checksum in the root metadata (written after the head, so a recorded checksum always has its head)."""
        raw = encode_head(self.spec, embed_tokens, lm_head)
        record = {"crc32c": crc32c(raw), "nbytes": len(raw)}
        if self.storage.exists(HEAD_KEY):
            if self.storage.get(HEAD_KEY) != raw:
                raise CacheError(f"{self.url} already holds a different {HEAD_KEY}; the head is written once "
                                 "(a different teacher needs a new cache)")
        else:
            self.storage.put(HEAD_KEY, raw, durable=True)
        attrs = _root_attrs(self.storage)
        if attrs is None:
            raise NotACacheError(f"{self.url} has no zarr.json at its root: not a cache any more")
        if attrs.get("head") != record:
            self.storage.put("zarr.json", _group_json({ATTR_KEY: {**attrs, "head": record}}), durable=True)

    def has_head(self) -> bool:
        return self.storage.exists(HEAD_KEY)

    def head_record(self) -> dict[str, int] | None:
        """``{"crc32c", "nbytes"}`` of the head as recorded in the root metadata (None: not recorded)."""
        attrs = _root_attrs(self.storage) or {}
        return attrs.get("head")

    def head_problem(self, raw: bytes | None) -> str | None:
        """Why the head bytes ``raw`` (None: missing) cannot be trusted, or None."""
        if raw is None:
            return (f"{HEAD_KEY} is missing: extraction stores the teacher's embedding and lm_head there; rerun "
                    "dflash-extract with the same config and --out (it writes the head and keeps the parts)")
        rec = self.head_record()
        if rec is None:
            return (f"{HEAD_KEY} has no checksum in the root metadata (written by an older dflash-extract, or "
                    "interrupted); rerun dflash-extract with the same config and --out to record it")
        if len(raw) != int(rec["nbytes"]) or crc32c(raw) != int(rec["crc32c"]):
            return (f"{HEAD_KEY} does not match its checksum in the root metadata ({len(raw)} bytes, recorded "
                    f"{rec['nbytes']}): the file is damaged; delete it and rerun dflash-extract with the same "
                    "config and --out to rewrite it")
        return None

    def load_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embed_tokens [V, H], lm_head [V, H])``; lm_head is the embedding when tied. The bytes are
        checked against the checksum in the root metadata."""
        try:
            raw = self.storage.get(HEAD_KEY)
        except FileNotFoundError:
            raw = None
        problem = self.head_problem(raw)
        if problem is not None:
            raise CacheCorruptError(f"{self.url}: {problem}", array=HEAD_KEY)
        return decode_head(raw, self.spec)  # type: ignore[arg-type]

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

    def part_writer(self, bucket: int, name: str, meta: dict[str, Any] | None = None,
                    lease: PartLease | None = None) -> PartWriter:
        """A writer that owns part ``buckets/<bucket>/<name>/`` (names unique per bucket); it takes the
        part's lease unless given it (see :class:`PartWriter`)."""
        return PartWriter(self, bucket, name, meta, lease=lease)

    def _part_dirs(self) -> list[tuple[int, str]]:
        out = []
        for b in range(self.spec.n_buckets):
            for name in self.storage.list_dir(f"buckets/{b}"):
                if name != "zarr.json" and not name.startswith("."):
                    out.append((b, name))
        return out

    def parts(self) -> list[PartInfo]:
        """Committed parts only, ordered by (bucket, name). Raises on the first unreadable commit record."""
        parts, bad = self.scan_parts()
        if bad:
            raise bad[0]
        return parts

    def scan_parts(self) -> tuple[list[PartInfo], list[CacheCorruptError]]:
        """``(committed parts, one error per part whose commit record cannot be trusted)``."""
        out, bad = [], []
        dirs = self._part_dirs()
        for (b, name), raw in zip(dirs, self._commit_records(dirs), strict=True):
            key = part_key(b, name)
            if raw is None:
                continue
            try:
                info = PartInfo.from_record(raw, key)
            except CacheCorruptError as err:
                bad.append(err)
                continue
            if (info.bucket, info.name) != (b, name):
                bad.append(CacheCorruptError(f"part {key}: its commit record names {part_key(info.bucket, info.name)};"
                                             " a part directory was moved or copied", part=key, array=COMMIT))
                continue
            if info.cache_fingerprint != self.spec.fingerprint:
                bad.append(CacheCorruptError(
                    f"part {key}: its commit record was written for cache fingerprint {info.cache_fingerprint}, this "
                    f"cache is {self.spec.fingerprint} (another job wrote into this cache with another spec, or the "
                    "part was copied from another cache); delete the part's directory and rerun dflash-extract",
                    part=key, array=COMMIT))
                continue
            out.append(info)
        return out, bad

    def _commit_records(self, dirs: list[tuple[int, str]]) -> list[bytes | None]:
        """The commit record of each part directory (None: not committed). On remote stores they are read
        16 at a time: a scan of thousands of parts is bound by latency, not bandwidth."""
        kept = self.storage.small_arrays  # (remote stores) a commit record, once created, is never rewritten

        def get(d: tuple[int, str]) -> bytes | None:
            key = f"{part_key(*d)}/{COMMIT}"
            if kept is not None and (got := kept.get((key, 0))) is not None:
                return got
            try:
                raw = self.storage.get(key)
            except (FileNotFoundError, NotADirectoryError):  # uncommitted, or a stray file (verify lists it)
                return None
            if kept is not None:
                kept[(key, 0)] = raw
            return raw

        if self.storage.is_local or len(dirs) <= 1:
            return [get(d) for d in dirs]
        with concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="dflash-scan") as pool:
            return list(pool.map(get, dirs))

    def uncommitted(self) -> list[str]:
        """Keys (``buckets/<b>/<name>``) of part directories without a commit record."""
        return [k for b, n in self._part_dirs()
                if not self.storage.exists(f"{(k := part_key(b, n))}/{COMMIT}") and not self._is_file(k)]

    def _is_file(self, key: str) -> bool:
        if self.storage.list_dir(key):
            return False
        try:
            self.storage.get(key)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
            return False
        return True

    def stray_files(self) -> list[str]:
        """Files in the bucket directories where only part directories belong (nothing reads them)."""
        return [part_key(b, n) for b, n in self._part_dirs()
                if not self.storage.exists(f"{part_key(b, n)}/{COMMIT}") and self._is_file(part_key(b, n))]

    def gc(self, min_age_s: float = LEASE_TIMEOUT_S, dry_run: bool = False) -> list[str]:
        """Remove uncommitted leftovers whose writer is gone. Returns the keys removed (or that would be).

        A leftover is kept while its lease is live: its writer runs in this pid namespace, or (other
        hosts) refreshed its heartbeat within ``min_age_s``. A removal takes the part's lease first,
        so it never races a writer that starts meanwhile, and never touches a committed part.
        """
        removed = []
        parts, _ = self.scan_parts()
        for part in parts:  # committed parts: files of writers that lost the part (never read)
            if dry_run:
                removed += [f"{part.key}/{n}" for n in garbage_of_committed(self.storage, part.key, part.gen)]
            else:
                removed += remove_garbage_of_committed(self.storage, part.key, part.gen)
        for key in self.uncommitted():
            holder = live_holder(self.storage, key, min_age_s)
            if holder is not None:
                log.info("keeping %s: %s is writing it", key, holder.describe())
                continue
            if dry_run:
                if commit_sealed(self.storage, key):  # (resolved when leased: committed if it verifies)
                    log.info("%s: a generation sealed for its commit; gc commits it if it verifies", key)
                    continue
                removed.append(key)
                continue
            try:
                lease = acquire(self.storage, key, timeout_s=min_age_s)
            except (LeaseHeldError, PartCommittedError):
                continue
            try:
                lease.clear_leftovers()
            except PartCommittedError:
                lease.release()
                continue
            remove_dead_seals(self.storage, key)  # (this process holds the lease: no writer can seal meanwhile)
            if {n for n in self.storage.list_dir(key) if not is_lease_file(n)} == {"zarr.json"}:
                self.storage.remove(f"{key}/zarr.json")  # the part's group document alone: nothing to keep
            lease.release(remove_dir=True)
            removed.append(key)
        return removed

    def lost_generations(self, parts: list[PartInfo] | None = None) -> list[PartInfo]:
        """Committed parts whose commit record names a generation of which no file is left (removed by a
        writer that lost the part, before generations carried their writer's token): nothing can read
        them, and only rewriting them repairs the cache."""
        named = [p for p in (self.parts() if parts is None else parts) if p.gen is not None]

        def lost(p: PartInfo) -> bool:
            return not self.storage.list_dir(p.data_key)

        if self.storage.is_local or len(named) <= 1:
            return [p for p in named if lost(p)]
        with concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="dflash-scan") as pool:  # (latency-bound)
            return [p for p, gone in zip(named, pool.map(lost, named), strict=True) if gone]

    def reopen_lost_parts(self, timeout_s: float = LEASE_TIMEOUT_S) -> list[str]:
        """Make every part of :meth:`lost_generations` uncommitted again, so that the extraction writes it
        anew: under the part's lease (no other writer can commit it meanwhile) its commit record is
        checked again and removed, with the logged reason. Returns the keys reopened; a part whose lease a
        live process holds is left to it."""
        reopened = []
        for part in self.lost_generations():
            try:
                lease = acquire_committed(self.storage, part.key, timeout_s)
            except LeaseHeldError:
                continue
            try:
                try:
                    raw = self.storage.get(f"{part.key}/{COMMIT}")
                except FileNotFoundError:
                    continue
                now = PartInfo.from_record(raw, part.key)
                if now.gen != part.gen or self.storage.list_dir(now.data_key):
                    continue  # (rewritten meanwhile)
                log.warning("part %s: its commit record names generation %s, of which no file is left (removed by "
                            "a writer that lost the part); the record is removed and the part written again",
                            part.key, part.gen.dir)  # type: ignore[union-attr]
                self.storage.remove(f"{part.key}/{COMMIT}")
                with contextlib.suppress(FileNotFoundError):
                    self.storage.remove(seal_key(part.key, part.gen))  # type: ignore[arg-type]
                reopened.append(part.key)
            finally:
                lease.release()
        return reopened

    # -- index and reads --------------------------------------------------------------------------

    def index(self, skip_corrupt: bool = False) -> CacheIndex:
        """A fresh index of every committed sample, from the small arrays only. With ``skip_corrupt``
        parts whose commit record or small arrays cannot be read are left out and listed in
        ``index.skipped`` instead of raising."""
        if not skip_corrupt:
            self._index = build_index(self.storage, self.parts())
            return self._index
        parts, bad = self.scan_parts()
        self._index = build_index(self.storage, parts, skip_corrupt=True)
        self._index.skipped = [*bad, *self._index.skipped]
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


# -- create / open ---------------------------------------------------------------------------------


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


def bucket_group_json(spec: CacheSpec, b: int) -> bytes:
    lo, hi = bucket_bounds(spec.bucket_edges, spec.max_length, b)
    return _group_json({"lo": lo, "hi": hi})


def _write_bucket_groups(storage: Storage, spec: CacheSpec) -> None:
    """The group documents of ``buckets/`` and each bucket, where missing. Only after the root exists with
    this spec: they are fixed by the spec, so every writer writes the same bytes."""
    for b in range(spec.n_buckets):
        if not storage.exists(f"buckets/{b}/zarr.json"):
            storage.put(f"buckets/{b}/zarr.json", bucket_group_json(spec, b))
    if not storage.exists("buckets/zarr.json"):
        storage.put("buckets/zarr.json", _group_json({}))


def open_cache(url: str, storage: Storage | None = None) -> FeatureCache:
    """Open an existing cache (local path or fsspec URL)."""
    storage = storage or make_storage(str(url))
    storage.preflight()
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
    storage.preflight()
    storage.check_exclusive_create()  # writers rely on it: refuse a store that ignores it
    if storage.root_is_file():
        raise NotACacheError(f"{url} is a file, not a cache directory; point --out at a new path (a directory is "
                             "created there) or at an existing cache")
    attrs = _root_attrs(storage) if storage.root_exists() else None
    foreign = {n for n in storage.list_dir("") if not n.startswith(".")} - {"buckets", "zarr.json"}
    if attrs is None and foreign:  # (hidden names: another creator's temporary files, mid-write)
        attrs = _root_attrs(storage)  # another process may have just finished creating it
        if attrs is None:
            raise NotACacheError(f"{url} is a non-empty directory without a cache in it; choose a new or empty path")
    raced = False
    if attrs is None:
        root = {"format_version": FORMAT_VERSION, "spec": spec.to_dict(), "fingerprint": spec.fingerprint,
                "layout": {"chunk_tokens": chunk_tokens, "shard_tokens": shard_tokens}}
        # Create-if-absent: of several jobs starting at once, exactly one creates the cache; the others read
        # what it wrote and open it (same spec: the same job) or are refused (another spec) before they write
        # anything
        if storage.create_exclusive("zarr.json", _group_json({ATTR_KEY: root}), durable=True):
            _write_bucket_groups(storage, spec)
            log.info("created cache %s (codec %s, fingerprint %s)", url, spec.codec, spec.fingerprint)
            return FeatureCache(storage, spec, chunk_tokens, shard_tokens)
        attrs = _root_attrs(storage)
        if attrs is None:
            raise NotACacheError(f"{url}: zarr.json exists but cannot be read; choose a new or empty path")
        raced = True
    cache = _cache_from_attrs(storage, attrs)
    if cache.spec.fingerprint != spec.fingerprint:
        how = "was created by another job at the same moment, with" if raced else "was written with"
        raise SpecMismatchError(f"{url} {how} another spec: {describe_diff(cache.spec, spec)}. Use a new cache "
                                "path, or change the config to match", fields=cache.spec.diff(spec))
    _write_bucket_groups(storage, spec)  # (restores any a crash or a user removed)
    return cache

"""Sealed but uncommitted generations, resolved by the part's next lease holder.

A writer makes its generation durable, seals it for the commit (the seal carries the commit record,
:func:`dflash_cache.fence.commit_seal`), then creates the commit record. If it dies in between (or is
frozen past its lease, or its host is lost) the generation is complete but no reader sees it, and no
remover may touch it (its seal says ``commit``). The next holder of the part's lease -- a rerun or
takeover writer, a job leasing the part's work unit, ``dflash-cache gc`` -- resolves it as it takes the
lease (:func:`dflash_cache.lease.acquire`):

- when the data verifies against the sealed record (the record is consistent and names this part,
  this generation and this cache; then every check of ``verify``: metadata, counts, small-array and
  whole-array checksums, finiteness) the holder creates the commit record itself, exclusively, with
  the sealed bytes: the part is committed as its writer meant it, and nothing is recomputed. A late
  writer that resumes afterwards finds the record naming its own generation and reports success;
- otherwise (damaged data, a seal without a record) the generation is removed, logged with the reason.

Limit: a writer frozen exactly between its own lease check and its commit-record create, for longer
than the lease timeout, whose sealed data does not verify, would create a record naming a removed
generation when it resumes; readers and ``verify`` then refuse that part (exit 2, naming it).
"""

from __future__ import annotations

import contextlib
import logging

from .buckets import bucket_bounds
from .errors import CacheError
from .fence import commit_sealed, remove_garbage_of_committed, seal_key, sealed_record
from .part_checks import check_part
from .parts import COMMIT, PART_GROUP, Generation, PartInfo
from .spec import CacheSpec, root_attrs
from .storage import Storage

log = logging.getLogger(__name__)


def resolve_sealed(storage: Storage, key: str, holder: Generation) -> bool:
    """Resolve the generations of uncommitted part ``key`` that ``holder`` (the caller's generation, whose
    lease it holds) supersedes and that were sealed for a commit but have no commit record. True when one
    of them is committed now (the part is then complete; the others are removed as its garbage)."""
    gens = [g for g in commit_sealed(storage, key) if g.superseded_by(holder)]
    if not gens or storage.exists(f"{key}/{COMMIT}"):
        return False
    for g in reversed(gens):  # the newest first
        raw = storage.get(seal_key(key, g))
        record = sealed_record(raw)
        why = _unverified(storage, key, g, record)
        if why is None:
            assert record is not None
            storage.put(f"{key}/zarr.json", PART_GROUP, durable=True)
            if storage.create_exclusive(f"{key}/{COMMIT}", record, durable=True) or \
                    storage.get(f"{key}/{COMMIT}") == record:
                log.warning("part %s: committed generation %s, which its writer sealed for its commit but did not "
                            "commit (it stopped in between); its data verifies against the sealed record", key, g.dir)
                with contextlib.suppress(OSError):
                    remove_garbage_of_committed(storage, key, g)
                return True
            return False  # committed meanwhile by someone else: the caller finds the record
        log.warning("part %s: removing generation %s, sealed for a commit by a writer that stopped before its "
                    "commit record, because %s; the part is written again", key, g.dir, why)
        storage.remove_entry(f"{key}/{g.dir}")
        with contextlib.suppress(FileNotFoundError):
            storage.remove(seal_key(key, g))
    return False


def _unverified(storage: Storage, key: str, gen: Generation, record: bytes | None) -> str | None:
    """Why generation ``gen`` cannot be committed with ``record`` (None: it can)."""
    if record is None:
        return "its seal does not carry the commit record (written by an older version)"
    if not storage.list_dir(f"{key}/{gen.dir}"):
        return "its data directory is missing"
    try:
        info = PartInfo.from_record(record, key)
    except CacheError as err:
        return f"its sealed record cannot be read ({err})"
    if info.key != key or info.gen != gen:
        return f"its sealed record names part {info.key} generation {info.gen.dir if info.gen else None}"
    attrs = root_attrs(storage)
    if attrs is None:
        return "the cache's root document is missing"
    spec = CacheSpec.from_dict(attrs["spec"])
    if info.cache_fingerprint != spec.fingerprint:
        return f"its sealed record is for cache fingerprint {info.cache_fingerprint}, not {spec.fingerprint}"
    storage.put(f"{key}/zarr.json", PART_GROUP, durable=True)  # (constant; its writer may not have got to it)
    return check_part(storage, info, bucket_bounds(spec.bucket_edges, spec.max_length, info.bucket))

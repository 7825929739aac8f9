"""The part writer: one writer owns one part, buffers one shard in memory and writes it whole.

Ownership: a writer holds the part's lease (:mod:`dflash_cache.lease`) from start to commit, so no
other process writes, clears or commits the same part meanwhile; the leftover of a dead writer is
cleared by the next holder, and a part with a commit record is never touched again.

Fencing: the writer writes only under its generation's directory ``<part>/g<number>-<token>/`` and the
commit record names that generation, so a writer that lost its lease (frozen past the lease
timeout, then resumed) writes only garbage that nothing reads (:mod:`dflash_cache.fence`).

Durability protocol: data arrays are written (whole shards, then the small arrays at commit), every
file of the generation directory is fsynced with the directories that reach it (local filesystems),
the generation is sealed for the commit, the part's group document is written, then
``commit.json`` is created last, atomically, exclusively and durably. The commit record also binds
each shard to the part: the crc32c of every shard's chunk index (checked by readers whenever they
open a shard, at no extra read) and of every small array (checked when it is loaded). Readers list
parts that have a commit record only, so a writer killed at any moment leaves no visible part; its
directory is an uncommitted leftover that the next writer of the part (or ``gc``) clears.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Protocol

import numpy as np
import torch
import zarr

from .codecs import (
    CODEC_INFO,
    FEATURE_BLOSC,
    SMALL_BLOSC,
    BloscParams,
    bf16_to_u16,
    chunk_table,
    crc32c,
    encode_shard,
    feature_compressors,
    inline_encode,
    quantize_fp8,
    small_compressors,
)
from .errors import CacheError, DataError
from .fence import remove_garbage_of_committed, seal_for_commit, seal_key
from .lease import HEARTBEAT_S, LeaseLostError, PartCommittedError, PartLease, acquire, released_at
from .locks import host_name
from .parts import COMMIT, PART_GROUP, PartInfo, check_part_name, part_key
from .runtime.switches import env_switch
from .spec import CacheSpec
from .storage import Storage


class CacheLayout(Protocol):
    """What a part writer needs of its cache (:class:`~dflash_cache.store.FeatureCache` is one; the writer
    does not import the store, which builds writers)."""

    storage: Storage
    spec: CacheSpec
    chunk_tokens: int
    shard_tokens: int

    def bucket_of(self, length: int) -> int: ...

    def bucket_bounds(self, b: int) -> tuple[int, int]: ...


log = logging.getLogger(__name__)

_ZCONFIG = {"write_empty_chunks": True}
_PART_GROUP = PART_GROUP  # the part's own group document (constant: any writer may put it)


def _as_1d(x: Any, name: str, sample_id: int) -> np.ndarray:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 1:
        raise DataError(f"sample {sample_id}: {name} must be 1-D [T], got shape {list(a.shape)}")
    return a


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x``: one min/max pass (NaN propagates through both), ~15x faster on the CPU than
    ``isfinite(x).all()``, which materialises a boolean tensor of ``x``'s size."""
    if x.numel() == 0 or not x.is_floating_point():
        return True
    lo, hi = torch.aminmax(x.detach())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


class _ShardedArray:
    """A token-sharded 2-D array written one whole shard at a time; tracks a crc32c of all rows.

    zarr writes the array metadata; the shard objects are encoded here (the zarr sharding format:
    inner chunks, then their index) and put whole, which avoids zarr's per-chunk overhead.
    """

    def __init__(self, cache: CacheLayout, part: str, name: str, width: int, dtype: str,
                 params: BloscParams | None, compressors: list, attrs: dict[str, Any]):
        self.storage, self.key = cache.storage, f"{part}/{name}"
        self.chunk, self.shard, self.params = cache.chunk_tokens, cache.shard_tokens, params
        self.arr = zarr.create_array(cache.storage.zarr_store(part), name=name, shape=(0, width), dtype=dtype,
                                     chunks=(self.chunk, width), shards=(self.shard, width), compressors=compressors,
                                     fill_value=0, attributes=attrs, config=_ZCONFIG)
        self.buf = np.empty((self.shard, width), dtype=dtype)
        self.fill = 0  # rows buffered
        self.written = 0  # rows on storage
        self.crc = 0
        self.index_crcs: list[int] = []  # per shard: the crc32c that ends its chunk index (binds it to the part)
        self.chunk_tables: list[str] = []  # per shard: its chunks' (stored bytes, crc32c), see chunk_table

    def push(self, rows: np.ndarray) -> None:
        pos = 0
        while pos < rows.shape[0]:
            take = min(rows.shape[0] - pos, self.buf.shape[0] - self.fill)
            self.buf[self.fill:self.fill + take] = rows[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == self.buf.shape[0]:
                self.flush()

    def flush(self) -> None:
        if not self.fill:
            return
        data = self.buf[:self.fill]
        shard = self.written // self.shard
        blob = encode_shard(data, self.chunk, self.shard, self.params)  # one whole shard (or the final partial one)
        self.storage.put(f"{self.key}/c/{shard}/0", blob)
        self.index_crcs.append(int.from_bytes(blob[-4:], "little"))
        self.chunk_tables.append(chunk_table(blob, self.shard // self.chunk))
        self.crc = crc32c(data, self.crc)
        self.written += self.fill
        self.fill = 0

    def finish(self) -> dict[str, Any]:
        self.flush()
        self.arr.resize((self.written, self.buf.shape[1]))  # metadata only: the shards are in place
        return {"shape": [self.written, self.buf.shape[1]], "dtype": str(self.buf.dtype), "crc32c": self.crc,
                "shard_index_crc32c": self.index_crcs, "shard_chunks": self.chunk_tables}


class PartWriter:
    """Writes one part ``buckets/<bucket>/<name>/``. Use :meth:`add`, then :meth:`commit` (or :meth:`abort`).

    As a context manager it commits on a clean exit and aborts on an exception. ``lease``: the part's
    lease when the caller took it already (else the writer takes it, raising
    :class:`~dflash_cache.lease.LeaseHeldError` when a live process writes the part).
    """

    def __init__(self, cache: CacheLayout, bucket: int, name: str, meta: dict[str, Any] | None = None,
                 lease: PartLease | None = None):
        spec = cache.spec
        if not 0 <= bucket < spec.n_buckets:
            raise CacheError(f"bucket {bucket} does not exist: this cache has buckets 0..{spec.n_buckets - 1}")
        self.cache, self.bucket, self.name = cache, bucket, check_part_name(name)
        self.meta = json.loads(json.dumps(meta or {}))  # must be JSON; copied
        self.key = part_key(bucket, name)
        self.codec = CODEC_INFO[spec.codec]
        self.n_samples = 0
        self.n_tokens = 0
        self._ids: list[int] = []
        self._id_set: set[int] = set()
        self._offsets = [0]
        self._tokens: dict[str, list[np.ndarray]] = {"input_ids": [], "loss_mask": [], "target_argmax": []}
        self._with_argmax: bool | None = None
        self._closed = False
        self._lease = lease if lease is not None else acquire(cache.storage, self.key)
        self.generation = self._lease.generation  # unique for ever: lease number + this writer's token
        self.data_key = f"{self.key}/{self.generation.dir}"  # this writer's files; nobody else's
        try:
            self._start()
        except BaseException:
            self._closed = True
            self._lease.release()
            raise

    # -- setup ------------------------------------------------------------------------------------

    def _start(self) -> None:
        st = self.cache.storage
        try:
            self._lease.clear_leftovers()  # of a dead earlier writer; raises when the part is committed
        except PartCommittedError:
            if not self._lease.held():  # taken over and committed by another process while this one stalled
                raise self._lost() from None
            raise
        self._store = st.zarr_store(self.data_key)
        zarr.create_group(self._store, attributes={"bucket": self.bucket, "name": self.name, "meta": self.meta})
        d, n = self.cache.spec.feature_dim, self.cache.spec.feature_slots
        self._features = _ShardedArray(self.cache, self.data_key, "features", d, self.codec.stored_dtype,
                                       FEATURE_BLOSC[self.codec.name], feature_compressors(self.codec.name),
                                       {"logical_dtype": self.codec.logical_dtype})
        self._scales = None
        if self.codec.has_scales:
            self._scales = _ShardedArray(self.cache, self.data_key, "scales", n, "float32", SMALL_BLOSC,
                                         small_compressors(4),
                                         {"meaning": "per-token, per-slot (layer or final state) fp8 scale (absmax / 448)"})

    # -- writing ----------------------------------------------------------------------------------

    def add(self, sample_id: int, input_ids: Any, loss_mask: Any, features: torch.Tensor,
            target_argmax: Any = None) -> None:
        """Append one sample of true length T: ``input_ids [T]``, ``loss_mask [T]``, ``features [T, n*H]``."""
        if self._closed:
            raise CacheError(f"part {self.key} is already committed or aborted; open a new part writer")
        sid = int(sample_id)
        ids = _as_1d(input_ids, "input_ids", sid)
        mask = _as_1d(loss_mask, "loss_mask", sid)
        t = self._check_sample(sid, ids, mask, features, target_argmax)
        self._push_features(sid, features)
        self._tokens["input_ids"].append(ids.astype(np.int32))
        self._tokens["loss_mask"].append(mask.astype(bool))
        if target_argmax is not None:
            self._tokens["target_argmax"].append(_as_1d(target_argmax, "target_argmax", sid).astype(np.int32))
        self._ids.append(sid)
        self._id_set.add(sid)
        self.n_samples += 1
        self.n_tokens += t
        self._offsets.append(self.n_tokens)

    def add_batch(self, sample_ids: Any, lengths: Any, input_ids: Any, loss_mask: Any, features: torch.Tensor,
                  target_argmax: Any = None) -> None:
        """Append several samples at once, concatenated along tokens (no padding): ``sample_ids [S]``,
        ``lengths [S]``, ``input_ids [sum(lengths)]``, ``loss_mask [sum]``, ``features [sum, n*H]``.
        Same checks as :meth:`add`, vectorised (for extraction batches and bulk copies)."""
        if self._closed:
            raise CacheError(f"part {self.key} is already committed or aborted; open a new part writer")
        sids = _as_1d(sample_ids, "sample_ids", -1).astype(np.int64)
        lens = _as_1d(lengths, "lengths", -1).astype(np.int64)
        ids, mask = _as_1d(input_ids, "input_ids", -1), _as_1d(loss_mask, "loss_mask", -1)
        argmax = None if target_argmax is None else _as_1d(target_argmax, "target_argmax", -1)
        self._check_batch(sids, lens, ids, mask, features, argmax)
        self._push_features(-1, features)
        self._tokens["input_ids"].append(ids.astype(np.int32))
        self._tokens["loss_mask"].append(mask.astype(bool))
        if argmax is not None:
            self._tokens["target_argmax"].append(argmax.astype(np.int32))
        self._ids.extend(sids.tolist())
        self._id_set.update(sids.tolist())
        self.n_samples += len(sids)
        self._offsets.extend((self.n_tokens + np.cumsum(lens)).tolist())
        self.n_tokens += int(lens.sum())

    def _check_batch(self, sids: np.ndarray, lens: np.ndarray, ids: np.ndarray, mask: np.ndarray,
                     features: torch.Tensor, argmax: np.ndarray | None) -> None:
        total = int(lens.sum())
        if len(sids) != len(lens) or len(np.unique(sids)) != len(sids) or self._id_set & set(sids.tolist()):
            raise DataError(f"part {self.key}: sample_ids must be unique and match lengths ({len(sids)} ids, "
                            f"{len(lens)} lengths)")
        if ids.shape[0] != total or mask.shape[0] != total or (argmax is not None and argmax.shape[0] != total):
            raise DataError(f"part {self.key}: input_ids/loss_mask/target_argmax must hold sum(lengths)={total} tokens")
        if tuple(features.shape) != (total, self.cache.spec.feature_dim):
            raise DataError(f"part {self.key}: features must be [{total}, {self.cache.spec.feature_dim}], "
                            f"got {list(features.shape)}")
        lo, hi = self.cache.bucket_bounds(self.bucket)
        if len(lens) and (lens.min() <= lo or lens.max() > min(hi, max(self.cache.spec.max_length, lo + 1))):
            raise DataError(f"part {self.key}: sample lengths {lens.min()}..{lens.max()} outside this bucket "
                            f"({lo}, {hi}]; route samples with cache.bucket_of(T)")
        if self._with_argmax is None:
            self._with_argmax = argmax is not None
        elif self._with_argmax != (argmax is not None):
            raise DataError(f"part {self.key}: target_argmax must be given for every sample of a part or for none")
        if not all_finite(features):
            raise DataError(f"part {self.key}: features contain NaN or Inf; skip those samples (extract.on_nonfinite)")

    def _check_sample(self, sid: int, ids: np.ndarray, mask: np.ndarray, features: torch.Tensor,
                      target_argmax: Any) -> int:
        t = ids.shape[0]
        spec = self.cache.spec
        if sid in self._id_set:
            raise DataError(f"sample {sid} was already added to part {self.key}: sample ids must be unique")
        if mask.shape[0] != t:
            raise DataError(f"sample {sid}: loss_mask has {mask.shape[0]} tokens, input_ids has {t}")
        if tuple(features.shape) != (t, spec.feature_dim):
            raise DataError(f"sample {sid}: features must be [T={t}, n*H={spec.feature_dim}], "
                            f"got {list(features.shape)}")
        b = self.cache.bucket_of(t)
        if b != self.bucket:
            lo, hi = self.cache.bucket_bounds(self.bucket)
            raise DataError(f"sample {sid} has {t} tokens, which belongs in bucket {b}, not in bucket "
                            f"{self.bucket} ({lo} < T <= {hi}); route samples with cache.bucket_of(T)")
        has = target_argmax is not None
        if self._with_argmax is None:
            self._with_argmax = has
        elif self._with_argmax != has:
            raise DataError(f"sample {sid}: target_argmax must be given for every sample of a part or for none")
        if has and len(target_argmax) != t:
            raise DataError(f"sample {sid}: target_argmax has {len(target_argmax)} tokens, input_ids has {t}")
        if not all_finite(features):
            raise DataError(f"sample {sid}: features contain NaN or Inf; skip the sample (extract.on_nonfinite)")
        return t

    def _lost(self, sealed: bool = False) -> LeaseLostError:
        """The error of a writer whose part was taken over (it drops its copy; the new owner's stands). A
        generation this writer sealed for its commit is left to the part's lease holder, who may be
        committing it (dflash_cache.recover) or removes it as garbage once its own copy is committed."""
        self._closed = True
        st = self.cache.storage
        if sealed and st.exists(f"{self.key}/{COMMIT}"):  # committed by another writer: this one is garbage now
            with contextlib.suppress(OSError):
                st.remove(seal_key(self.key, self.generation))  # (its own: the name carries its token)
            sealed = False
        if not sealed:
            with contextlib.suppress(OSError):
                st.remove_entry(self.data_key)  # this generation's files: nobody else's
        why = self._why_lost()
        self._lease.release()
        return LeaseLostError(f"part {self.key} was taken over by another process while this one wrote it ({why}); "
                              "this copy is dropped and the other writer's stands. Rerun the job to write what is "
                              "still missing")

    def _why_lost(self) -> str:
        """The figures behind a takeover: how old this process's heartbeat was, the timeouts, a release."""
        now, lease = time.time(), self._lease
        why = (f"this process's last lease heartbeat was {max(0.0, now - lease.last_beat_unix):.0f} s ago; it writes "
               f"one every {HEARTBEAT_S:.0f} s, and a part is taken over once its heartbeat is older than the taker's "
               f"extract.lease_timeout_s or gc --min-age ({lease.timeout_s:.0f} s in this process)")
        with contextlib.suppress(OSError):
            released = released_at(self.cache.storage, host_name())
            if released is not None and released > lease.last_beat_unix:
                why += (f"; `dflash-cache release --host {host_name()}` declared this host's leases dead "
                        f"{max(0.0, now - released):.0f} s ago")
        return why + ": was this process stopped, or its host frozen?"

    def _push_features(self, sid: int, features: torch.Tensor) -> None:
        try:
            self._push_features_unfenced(features)
        except Exception:
            if not self._closed and not self._lease.held():
                raise self._lost() from None
            raise

    def _push_features_unfenced(self, features: torch.Tensor) -> None:
        if self._scales is not None:
            q, s = quantize_fp8(features, self.cache.spec.feature_slots)  # on the features' device
            self._features.push(q.cpu().numpy())
            self._scales.push(s.cpu().numpy())
        else:
            self._features.push(bf16_to_u16(features))

    # -- commit / abort ---------------------------------------------------------------------------

    def _write_small(self, name: str, data: np.ndarray, inline: bool = False) -> dict[str, Any]:
        zarr.create_array(self._store, name=name, data=data, chunks=(max(len(data), 1),),
                          compressors=small_compressors(), fill_value=0, config=_ZCONFIG)
        rec = {"shape": [len(data)], "dtype": str(data.dtype), "crc32c": crc32c(data)}
        if inline:  # a copy in the commit record: readers of remote stores need no request for it
            rec["inline"] = inline_encode(data)
        return rec

    def commit(self) -> PartInfo:
        """Write the remaining data, make it durable, seal this generation, then create the commit
        record naming it. Returns the part."""
        if self._closed:
            raise CacheError(f"part {self.key} is already committed or aborted")
        try:
            info = self._finish_data()
        except Exception:
            if not self._closed and not self._lease.held():
                raise self._lost() from None
            raise
        if delay := env_switch("DFLASH_TEST_COMMIT_DELAY_S"):
            time.sleep(float(delay))  # test hook: widens the window in which a kill lands inside the commit
        st = self.cache.storage
        record = json.dumps(info.to_record(self.cache.spec.fingerprint), indent=1).encode()
        # sealed first, then the lease checked: a remover takes the lease before it seals a generation dead,
        # so either it sees this seal and keeps the files, or this writer sees its lease and stops. The seal
        # carries the record: should this writer stop before its commit record, the part's next lease holder
        # commits this generation with it once the data verifies (dflash_cache.recover)
        if not seal_for_commit(st, self.key, self.generation, record):
            raise self._lost()
        if not self._lease.held():
            if self._committed_as(record):  # the next holder committed this generation for us
                return self._committed(info)
            raise self._lost(sealed=True)
        # the same bytes from every writer: a plain put is safe; durable, as verify requires it of a commit
        st.put(f"{self.key}/zarr.json", _PART_GROUP, durable=True)
        if not st.create_exclusive(f"{self.key}/{COMMIT}", record, durable=True):  # visible from here on
            if self._committed_as(record):
                return self._committed(info)
            raise self._lost(sealed=True)
        return self._committed(info)

    def _committed_as(self, record: bytes) -> bool:
        """The part's commit record is ``record`` (created by this writer, or by the next lease holder that
        resolved this writer's sealed generation)."""
        try:
            return self.cache.storage.get(f"{self.key}/{COMMIT}") == record
        except FileNotFoundError:
            return False

    def _committed(self, info: PartInfo) -> PartInfo:
        st = self.cache.storage
        self._lease.release()
        self._closed = True
        with contextlib.suppress(OSError):  # late writers' garbage: nobody can commit this part any more
            remove_garbage_of_committed(st, self.key, self.generation)
        log.debug("committed part %s: %d samples, %d tokens", self.key, self.n_samples, self.n_tokens)
        return info

    def _finish_data(self) -> PartInfo:
        arrays: dict[str, dict[str, Any]] = {}
        for name, arr in (("features", self._features), ("scales", self._scales)):
            if arr is not None:
                arrays[name] = arr.finish()
        for name, chunks in self._tokens.items():
            if name == "target_argmax" and not self._with_argmax:
                continue
            data = np.concatenate(chunks) if chunks else np.zeros(0, np.int32 if name != "loss_mask" else bool)
            arrays[name] = self._write_small(name, data)
        arrays["offsets"] = self._write_small("offsets", np.asarray(self._offsets, np.int64), inline=True)
        arrays["sample_ids"] = self._write_small("sample_ids", np.asarray(self._ids, np.int64), inline=True)
        st = self.cache.storage
        st.sync_tree(self.data_key)
        sizes = st.list_files(self.data_key)
        for name, rec in arrays.items():
            rec["stored_bytes"] = sum(v for k, v in sizes.items() if k.startswith(f"{self.data_key}/{name}/"))
        return PartInfo(bucket=self.bucket, name=self.name, n_samples=self.n_samples, n_tokens=self.n_tokens,
                        meta=self.meta, codec=self.codec.name, arrays=arrays,
                        chunk_tokens=self.cache.chunk_tokens, shard_tokens=self.cache.shard_tokens,
                        generation=self.generation.number, writer=self.generation.token,
                        cache_fingerprint=self.cache.spec.fingerprint)

    def abort(self) -> None:
        """Drop everything written so far; the part never becomes visible. Removes nothing when the
        lease was lost (the part is another writer's now) or the part is committed."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.cache.storage.remove_entry(self.data_key)  # this generation is never committed now
        if not self._lease.held():
            self._lease.release()
            return
        with contextlib.suppress(PartCommittedError):
            self._lease.clear_leftovers()
        self._lease.release(remove_dir=True)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.commit()

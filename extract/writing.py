"""Background part writing: compression and storage I/O off the compute path, with bounded memory.

The compute loop hands each batch's host features to :meth:`BackgroundWriter.submit_rows` and moves
on; writer threads add the samples to their parts and commit them. A part is owned by one thread
(chosen by bucket), so samples reach it in submission order and every run writes identical parts.
The bytes of batches not yet written are capped by ``max_inflight_bytes``: only when that bound is
hit does the compute loop wait (counted as ``stall_s``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_cache.errors import DataError
from dflash_cache.lease import PartLease
from dflash_cache.parts import PartInfo
from dflash_cache.protocols import PartSink, WritableCache
from dflash_cache.storage import storage_error

log = logging.getLogger(__name__)


@dataclass
class RowJob:
    """One sample to write: row ``row`` of the batch tensors, true length ``length``."""

    row: int
    sample_id: int
    input_ids: Any  # np.int64 [T]
    loss_mask: Any  # np.bool_ [T]
    bucket: int
    part: str
    meta: dict[str, Any]


@dataclass
class _Ticket:
    nbytes: int
    pending: int


@dataclass
class WriteStats:
    n_samples: int = 0
    n_tokens: int = 0
    n_nonfinite: int = 0
    n_parts: int = 0
    bytes_written: int = 0
    stall_s: float = 0.0
    nonfinite_ids: list[int] = field(default_factory=list)


class BackgroundWriter:
    """Writer threads that own the open parts of this process."""

    def __init__(self, cache: WritableCache, n_threads: int, max_inflight_bytes: int, on_nonfinite: str,
                 on_commit: Callable[[PartInfo], None] | None = None):
        self.cache = cache
        self.max_inflight = max_inflight_bytes
        self.on_nonfinite = on_nonfinite
        self.on_commit = on_commit
        self.stats = WriteStats()
        self._lock = threading.Condition()
        self._inflight = 0
        self._error: BaseException | None = None
        self._writers: dict[tuple[int, str], PartSink] = {}
        self._leases: dict[tuple[int, str], PartLease] = {}  # leases taken by the compute side, not yet opened
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(n_threads)]
        self._threads = [threading.Thread(target=self._loop, args=(q,), name=f"dflash-writer-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    # -- compute side -------------------------------------------------------------------------------

    def submit_rows(self, features: torch.Tensor, argmax: torch.Tensor | None, ready: Any,
                    rows: list[RowJob]) -> None:
        """Queue ``rows`` of ``features [B, T, D]`` (host, or being copied there until ``ready``)."""
        nbytes = features.numel() * features.element_size()
        self._reserve(nbytes)
        by_thread: dict[int, list[RowJob]] = {}
        for r in rows:
            by_thread.setdefault(self._thread_of(r.bucket), []).append(r)
        ticket = _Ticket(nbytes, len(by_thread))
        for i, rs in by_thread.items():
            self._queues[i].put(("rows", features, argmax, ready, rs, ticket))
        if not by_thread:
            self._release(ticket)

    def adopt(self, bucket: int, part: str, lease: Any) -> None:
        """Hand over the lease of part ``(bucket, part)`` (taken before its unit runs) to its writer."""
        with self._lock:
            self._leases[(bucket, part)] = lease

    def submit_commit(self, bucket: int, part: str, meta: dict[str, Any]) -> None:
        """Commit part ``(bucket, part)`` after its queued rows (an empty part if none arrived)."""
        self.raise_if_failed()
        self._queues[self._thread_of(bucket)].put(("commit", bucket, part, meta))

    def close(self) -> WriteStats:
        """Wait for every queued write; raise the first writer error."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self.raise_if_failed()
        return self.stats

    def abort(self) -> None:
        """Stop: drop queued work and abort open parts (committed parts are untouched)."""
        with self._lock:
            if self._error is None:
                self._error = RuntimeError("extraction aborted")
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=60)
        for w in list(self._writers.values()):
            w.abort()
        self._writers.clear()
        self._release_leases(lambda key: True)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _thread_of(self, bucket: int) -> int:
        return bucket % len(self._queues)

    def _reserve(self, nbytes: int) -> None:
        t0 = time.perf_counter()
        with self._lock:
            while self._inflight and self._inflight + nbytes > self.max_inflight and self._error is None:
                self._lock.wait(timeout=1.0)
            self._inflight += nbytes
        self.stats.stall_s += time.perf_counter() - t0
        self.raise_if_failed()

    def _release(self, ticket: _Ticket) -> None:
        with self._lock:
            ticket.pending -= 1
            if ticket.pending <= 0:
                self._inflight -= ticket.nbytes
                self._lock.notify_all()

    # -- writer threads ------------------------------------------------------------------------------

    def _loop(self, q: queue.Queue) -> None:
        while (item := q.get()) is not None:
            try:
                if self._error is None:
                    self._handle(item)
            except OSError as err:  # disk full, permissions ...: a CacheError naming the part
                self._fail(storage_error(err, self.cache.url, f"writing part {_item_part(item)}"))
            except BaseException as err:  # noqa: BLE001 - handed to the compute thread
                self._fail(err)
            finally:
                if item[0] == "rows":
                    self._release(item[-1])

    def _handle(self, item: tuple) -> None:
        if item[0] == "rows":
            _, features, argmax, ready, rows, _ticket = item
            if ready is not None:
                ready.synchronize()  # the device->host copy of this batch is complete
            for r in rows:
                self._write_row(features, argmax, r)
        else:
            _, bucket, part, meta = item
            self._commit(bucket, part, meta)

    def _writer(self, bucket: int, part: str, meta: dict[str, Any]) -> Any:
        key = (bucket, part)
        if key not in self._writers:
            with self._lock:
                lease = self._leases.pop(key, None)
            self._writers[key] = self.cache.part_writer(bucket, part, meta, lease=lease)
        return self._writers[key]

    def _write_row(self, features: torch.Tensor, argmax: torch.Tensor | None, r: RowJob) -> None:
        t = len(r.input_ids)
        feats = features[r.row, :t]  # [T, D]
        w = self._writer(r.bucket, r.part, r.meta)
        if not bool(torch.isfinite(feats).all()):
            if self.on_nonfinite == "error":
                raise DataError(f"sample {r.sample_id}: the teacher produced NaN/Inf features; set "
                                "extract.on_nonfinite = 'skip' to skip such samples (they are counted)")
            with self._lock:
                self.stats.n_nonfinite += 1
                self.stats.nonfinite_ids.append(r.sample_id)
            w.meta["n_nonfinite"] = int(w.meta.get("n_nonfinite", 0)) + 1  # in the commit record: the unit's count
            log.warning("sample %d: non-finite teacher features; skipped", r.sample_id)
            return
        labels = argmax[r.row, :t] if argmax is not None else None
        w.add(r.sample_id, r.input_ids, r.loss_mask, feats, target_argmax=labels)
        with self._lock:
            self.stats.n_samples += 1
            self.stats.n_tokens += t

    def _commit(self, bucket: int, part: str, meta: dict[str, Any]) -> None:
        w = self._writer(bucket, part, meta)
        info = w.commit()
        del self._writers[(bucket, part)]
        with self._lock:
            self.stats.n_parts += 1
            self.stats.bytes_written += sum(int(a.get("stored_bytes", 0)) for a in info.arrays.values())
        if self.on_commit is not None:
            self.on_commit(info)

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
            self._lock.notify_all()
        mine = self._thread_index()
        for key in [k for k in self._writers if self._thread_of(k[0]) == mine]:
            self._writers.pop(key).abort()
        self._release_leases(lambda key: self._thread_of(key[0]) == mine)

    def _release_leases(self, which: Callable[[tuple[int, str]], bool]) -> None:
        with self._lock:
            keys = [k for k in self._leases if which(k)]
            leases = [self._leases.pop(k) for k in keys]
        for lease in leases:
            lease.release(remove_dir=True)

    def _thread_index(self) -> int:
        return next(i for i, t in enumerate(self._threads) if t is threading.current_thread())


def _item_part(item: tuple) -> str:
    if item[0] == "rows":
        rows = item[4]
        return f"buckets/{rows[0].bucket}/{rows[0].part}" if rows else "?"
    return f"buckets/{item[1]}/{item[2]}"

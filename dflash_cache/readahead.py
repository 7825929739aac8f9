"""Read-ahead of planned feature bytes: few large range requests, many in flight, off the decode threads.

The loader knows its plan, so the byte ranges the next batches need are known before any decode
thread asks for them. :class:`ReadAhead` walks the work stream ahead of the decode threads (up to
``read_ahead_bytes`` of compressed bytes fetched or in flight), turns each planned sample into the
byte ranges of the shard chunks it covers, merges the ranges of a batch and of the batches planned after it that lie
in one shard object and are at most ``coalesce_gap_bytes`` apart into one request (at most
``max_request_bytes``, never splitting one sample's range), and keeps ``requests_in_flight`` such
requests running on its own threads. Decode threads read through :class:`ReadAheadStorage`: a range
that a fetched (or in-flight) block covers is served from memory; anything else is read directly,
as without read-ahead. The bytes are the same either way, so batches are bitwise the same and
resume (which restarts the stream at a plan position) is unchanged.

The walk also plans the items after it (up to twice ``read_ahead_bytes`` of their ranges): a request
for one item is widened to the ranges of the same object those next items need, and they are counted as
the block's users, so that it stays until they are decoded; a part's samples planned close together are
then fetched in few requests even when consecutive batches alternate between parts.

Memory is bounded: the walk stops while ``read_ahead_bytes`` are held (less a request's worth, up to half the
budget, kept free so that requests stay wide) and goes on as soon as blocks are dropped, so that requests
stay in flight while the decode threads work through what is held; a block is dropped as soon as every
batch that needed it has been assembled. Where the storage reads into a caller's buffer (local and
mounted filesystems, ``latency://``), a dropped block's buffer is reused by a later request
(:class:`BufferPool`): writing fresh memory costs a page fault per page, as much CPU as the read itself.
Metadata the ranges depend on (each part's offsets and shard indexes) is read for all parts new to a group
at once, in parallel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .storage import BytesRangeReader, RangeReader, Storage

T = TypeVar("T")
_WALK_STEP = 8  # items whose metadata is loaded together
_COLD_MIN_REQUEST = 1 << 20  # the smallest request the first batch's bytes are split into
# fetch buffers: private anonymous memory, its pages mapped in one call where the OS can (Linux: 30-40% less
# CPU than faulting them in one by one as the first read writes them)
_MAP_FLAGS = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)} if hasattr(
    mmap, "MAP_ANONYMOUS") else {}
Range = tuple[str, int, int]  # (object key, start, end) in bytes


@dataclass(frozen=True)
class ReadAheadSettings:
    read_ahead_bytes: int = 256 << 20
    requests_in_flight: int = 16
    coalesce_gap_bytes: int = 1 << 20
    max_request_bytes: int = 64 << 20


@dataclass
class ReadCounters:
    """What the read path did (``requests``: range requests issued for features, by read-ahead or
    directly; ``bytes_fetched``: bytes those returned; ``bytes_decoded``: compressed bytes handed to the decoders,
    a chunk shared by two samples counted for each)."""

    requests: int = 0
    direct_requests: int = 0
    bytes_fetched: int = 0
    bytes_decoded: int = 0
    metadata_requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kv: int) -> None:
        with self._lock:
            for k, v in kv.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("requests", "direct_requests", "bytes_fetched", "bytes_decoded",
                                               "metadata_requests")}


class BufferPool:
    """Fetch buffers, reused: a block's buffer goes back here when the block is dropped, and the next request
    of its size class reads into it. A fresh buffer costs a page fault per 4 KiB page when it is first written
    (in a VM, a trap to the host): 17-29 ms per 32 MiB on the machine of docs/performance.md, against 2 ms to
    read into a reused one. Size classes are powers of two from ``smallest`` (a buffer holds at most twice its
    request); free buffers beyond ``keep`` bytes are unmapped, largest first."""

    def __init__(self, keep: int, smallest: int = 1 << 20):
        self.keep, self.smallest = keep, max(smallest, mmap.PAGESIZE)
        self._free: dict[int, list[mmap.mmap]] = collections.defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.mapped = 0  # buffers mapped so far (a reused one counted once)

    def size_class(self, n: int) -> int:
        return max(self.smallest, 1 << (max(n, 1) - 1).bit_length())

    def acquire(self, n: int) -> mmap.mmap:
        size = self.size_class(n)
        with self._lock:
            if self._free[size]:
                self._free_bytes -= size
                return self._free[size].pop()
            self.mapped += 1
        return mmap.mmap(-1, size, **_MAP_FLAGS)

    def release(self, m: mmap.mmap) -> None:
        with self._lock:
            self._free[len(m)].append(m)
            self._free_bytes += len(m)
            while self._free_bytes > self.keep:
                size = max(k for k, v in self._free.items() if v)
                self._unmap(self._free[size].pop())

    def _unmap(self, m: mmap.mmap) -> None:  # (lock held; m taken off its list)
        self._free_bytes -= len(m)
        with contextlib.suppress(BufferError):  # (a view still exported: the mapping goes with its last view)
            m.close()

    def clear(self) -> None:
        with self._lock:
            for ms in self._free.values():
                while ms:
                    self._unmap(ms.pop())


class _Block:
    __slots__ = ("key", "lo", "hi", "future", "users", "readers", "dropped")

    def __init__(self, key: str, lo: int, hi: int, future: concurrent.futures.Future, users: int):
        self.key, self.lo, self.hi, self.future, self.users = key, lo, hi, future, users
        self.readers = 0  # decode threads reading it now (its buffer is not reused before they are done)
        self.dropped = False


class _Fetched:
    """A block's bytes: a view of a pooled buffer (given back with :meth:`ReadAhead._recycle`) or a bytes object."""

    __slots__ = ("view", "buffer")

    def __init__(self, view: memoryview | bytes, buffer: mmap.mmap | None = None):
        self.view, self.buffer = view, buffer


class _BlockReader(BytesRangeReader):
    """Reads of a block; closing it lets the block's buffer be reused once the block is dropped."""

    def __init__(self, ahead: ReadAhead, block: _Block, data: memoryview | bytes):
        super().__init__(data, block.lo)
        self._ahead, self._block = ahead, block

    def close(self) -> None:
        if self._block is not None:
            self._ahead._unread(self._block)
            self._block = None


def coalesce(ranges: Iterable[Range], gap: int, max_bytes: int) -> list[Range]:
    """Merge ranges of one object that overlap or lie at most ``gap`` bytes apart, while the merged
    request stays within ``max_bytes`` (a single longer range is kept whole)."""
    by_key: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for key, lo, hi in ranges:
        by_key[key].append((lo, hi))
    out: list[Range] = []
    for key in sorted(by_key):
        cur_lo, cur_hi = None, None
        for lo, hi in sorted(by_key[key]):
            if cur_lo is not None and lo - cur_hi <= gap and max(hi, cur_hi) - cur_lo <= max_bytes:
                cur_hi = max(cur_hi, hi)
                continue
            if cur_lo is not None:
                out.append((key, cur_lo, cur_hi))
            cur_lo, cur_hi = lo, hi
        if cur_lo is not None:
            out.append((key, cur_lo, cur_hi))
    return out


class ReadAhead:
    """See the module docstring. ``ranges_of(items)`` gives each item's byte ranges (it may read
    metadata; it is called on the walking thread); ``prepare(items)`` (optional) loads the metadata of
    a group in parallel first, using :meth:`map` ."""

    def __init__(self, storage: Storage, settings: ReadAheadSettings,
                 ranges_of: Callable[[Any], list[Range]], counters: ReadCounters | None = None,
                 prepare: Callable[[list[Any]], None] | None = None):
        self.storage, self.settings, self._ranges_of, self._prepare = storage, settings, ranges_of, prepare
        self.counters = counters or ReadCounters()
        self._pool = concurrent.futures.ThreadPoolExecutor(settings.requests_in_flight,
                                                           thread_name_prefix="dflash-fetch")
        # where the storage reads into a caller's buffer: buffers reused (up to the budget's worth kept free, so
        # that a new epoch or a resume, which drops every block, finds them again)
        self.buffers = BufferPool(settings.read_ahead_bytes) if getattr(storage, "reads_into", False) else None
        self._lock = threading.Lock()
        self._blocks: dict[str, list[_Block]] = collections.defaultdict(list)
        self._of_item: dict[int, list[_Block]] = {}  # the blocks each walked item uses (a user of each)
        self._pending: dict[int, list[_Block]] = {}  # blocks that items not yet walked are counted users of
        self._planned: dict[int, list[Range]] = {}  # the ranges of the items planned, not yet walked
        self._held = 0  # bytes of blocks not yet dropped
        self.max_held = 0  # the most ever held (bounded by read_ahead_bytes plus one walk step)
        self._cold = True  # nothing fetched since the start or a reset: the first item is split over every stream
        self._closed = False
        self.view = ReadAheadStorage(storage, self)

    # -- the walk --------------------------------------------------------------------------------

    def wrap(self, work: Iterator[T]) -> Iterator[T]:
        """``work`` in the same order, fetched ahead. The first item is issued and handed out at once (its bytes
        split over every stream); then the walk goes on whenever less than the budget (less the reserve: a
        request's worth, at most half the budget) is held, and walks until it is reached. The items after the walk (up to ``read_ahead_bytes`` of their
        ranges: the horizon) are planned too, so that a request for one item also covers the ranges that the
        next items need from the same object (see :meth:`_issue`)."""
        queue: collections.deque[T] = collections.deque()  # issued, not yet handed out
        spare: collections.deque[T] = collections.deque()  # metadata loaded, not yet issued
        spare_bytes = 0  # of the ranges of the items in spare
        exhausted = False
        budget = self.settings.read_ahead_bytes
        # room kept for widening: the walk pauses before the budget is so full that requests would be narrow
        # (refilling only at a quarter of the budget stalled the decode threads: a wide request streams for
        # 0.3 s at 100 MB/s, longer than what a quarter of 1 GiB lasts them)
        reserve = min(self.settings.max_request_bytes, budget // 2)
        first = self._cold = True  # the first item is issued (split over every stream) and handed out at once
        while True:
            held = self._held_bytes()
            if not queue or held < budget - reserve:
                walked = 0
                while (held < budget - reserve or not walked and not queue) and not self._closed:
                    while not exhausted and spare_bytes < 2 * budget and not (first and spare):  # the horizon
                        step = list(itertools.islice(work, _WALK_STEP))
                        exhausted = len(step) < _WALK_STEP
                        if self._prepare is not None and step:
                            self._prepare(step)  # metadata of the parts new to these items, in parallel
                        for item in step:
                            self._planned[id(item)] = rs = self._ranges_of(item)
                            spare_bytes += sum(hi - lo for _, lo, hi in rs)
                        spare.extend(step)
                    if not spare:
                        break
                    item = spare.popleft()
                    spare_bytes -= sum(hi - lo for _, lo, hi in self._planned[id(item)])
                    held = self._issue(item, spare, budget)
                    queue.append(item)
                    walked += 1
                    if first:  # hand it out before planning the horizon: the decode threads start now
                        first = False
                        break
            if not queue:
                return
            yield queue.popleft()

    def _held_bytes(self) -> int:
        with self._lock:
            return self._held

    def map(self, fn: Callable[[Any], Any], args: Iterable[Any]) -> list[Any]:
        """``fn`` over ``args`` on the fetch threads (metadata reads of a group, in parallel)."""
        return list(self._pool.map(fn, args))

    def _issue(self, item: Any, horizon: Iterable[Any], budget: int) -> int:
        """Attach ``item`` to the blocks that hold its ranges, requesting the ranges no block holds. Each
        request is widened to the ranges of the same object that the items of ``horizon`` (the next ones,
        in order) need, merged while at most ``coalesce_gap_bytes`` apart and within ``max_request_bytes``
        and the budget left; those items are counted as the block's users from then on, so that it stays
        until they are decoded. Returns the bytes held."""
        s = self.settings
        # (gaps read with a merge are held too: small budgets merge only small gaps)
        gap = min(s.coalesce_gap_bytes, s.read_ahead_bytes // 64)
        cap = min(s.max_request_bytes, s.read_ahead_bytes)
        ranges = self._planned.pop(id(item), None)
        if ranges is None:  # (planned before a reset)
            ranges = self._ranges_of(item)
        if self._cold:  # the first batch waits for all of its bytes: fetch them over every stream, not widened
            self._cold = False
            total = sum(hi - lo for _, lo, hi in ranges)
            cap = min(cap, max(_COLD_MIN_REQUEST, total // s.requests_in_flight))
            horizon = ()
        with self._lock:
            mine = self._pending.pop(id(item), [])
            missing: list[Range] = []
            for key, lo, hi in ranges:
                if any(b.lo <= lo and hi <= b.hi for b in mine if b.key == key):
                    continue
                b = next((b for b in self._blocks.get(key, ()) if b.lo <= lo and hi <= b.hi), None)
                if b is None:
                    missing.append((key, lo, hi))
                else:
                    b.users += 1
                    mine.append(b)
            held = self._held
        ahead: list[tuple[Any, list[Range]]] = []
        held_blocks: dict[str, list[_Block]] = {}
        if missing:
            keys = {k for k, _, _ in missing}
            with self._lock:
                held_blocks = {k: list(self._blocks.get(k, ())) for k in keys}
            for other in horizon:
                rs = [r for r in self._planned.get(id(other), ()) if r[0] in keys]
                if rs:
                    ahead.append((other, rs))
        new: list[_Block] = []
        for key, lo, hi in coalesce(missing, gap, cap):
            if any(b.key == key and b.lo <= lo and hi <= b.hi for b in new):
                continue
            # (an item spanning several objects widens each request to a reserve's worth even when the first
            # used the room left: the budget may be passed by that much, not cut into narrow requests)
            room = max(budget - held, min(cap, budget // 2), hi - lo)
            # the next items' ranges that no block holds or fetches yet (so that two requests of one item, or
            # of consecutive items, are not widened over the same bytes: they would be fetched twice)
            have = [(b.lo, b.hi) for b in (*held_blocks.get(key, ()), *new) if b.key == key]
            wide = [(k, a, z) for _, rs in ahead for k, a, z in rs
                    if k == key and not any(x <= a and z <= y for x, y in have)]
            wide = [r for r in coalesce([(key, lo, hi), *wide], gap, min(cap, room)) if r[1] <= lo and hi <= r[2]]
            lo, hi = (wide[0][1], wide[0][2]) if wide else (lo, hi)
            block = _Block(key, lo, hi, self._pool.submit(self._fetch, key, lo, hi), 1)
            new.append(block)
            mine.append(block)
            held += hi - lo
            for other, rs in ahead:
                if any(k == key and lo <= a and z <= hi for k, a, z in rs):
                    block.users += 1
                    self._pending.setdefault(id(other), []).append(block)
        with self._lock:
            # an item whose ranges lie in one block is that block's user once
            self._of_item[id(item)] = mine
            for b in new:
                self._blocks[b.key].append(b)
                self._held += b.hi - b.lo
            self.max_held = max(self.max_held, self._held)
            return self._held

    def _fetch(self, key: str, lo: int, hi: int) -> _Fetched:
        if self.buffers is None:
            data = self.storage.get_range(key, lo, hi)
            self.counters.add(requests=1, bytes_fetched=len(data))
            return _Fetched(data)
        buf = self.buffers.acquire(hi - lo)
        try:
            view = memoryview(buf)[:hi - lo]
            got = self.storage.read_into(key, lo, view)
        except BaseException:
            view.release()
            self.buffers.release(buf)
            raise
        self.counters.add(requests=1, bytes_fetched=got)
        return _Fetched(view[:got], buf)

    # -- serving and releasing -------------------------------------------------------------------

    def lookup(self, key: str, lo: int, hi: int) -> RangeReader | None:
        with self._lock:
            block = next((b for b in self._blocks.get(key, ()) if b.lo <= lo and hi <= b.hi), None)
            if block is None:
                return None
            block.readers += 1
        try:
            return _BlockReader(self, block, block.future.result().view)
        except BaseException:
            self._unread(block)
            raise

    def _unread(self, block: _Block) -> None:
        with self._lock:
            block.readers -= 1
            free = block.dropped and block.readers == 0
        if free:
            self._recycle(block)

    def _recycle(self, block: _Block) -> None:
        """A dropped block nobody reads: its buffer back to the pool once its fetch has ended."""
        if self.buffers is None:
            return

        def back(future: concurrent.futures.Future) -> None:
            if future.cancelled() or future.exception() is not None:
                return  # (a failed fetch gave its buffer back itself)
            fetched = future.result()
            if fetched.buffer is not None:
                view, fetched.view = fetched.view, b""
                view.release()
                self.buffers.release(fetched.buffer)

        block.future.add_done_callback(back)

    def done(self, item: Any) -> None:
        """Every range ``item`` needed has been decoded: drop the blocks nobody else needs."""
        free: list[_Block] = []
        with self._lock:
            for b in self._of_item.pop(id(item), []):
                b.users -= 1
                if b.users <= 0:
                    free += self._drop(b)
        for b in free:
            self._recycle(b)

    def _drop(self, b: _Block) -> list[_Block]:
        """(lock held) Returns the blocks to recycle (nobody reads them)."""
        blocks = self._blocks.get(b.key, [])
        if b in blocks:
            blocks.remove(b)
            self._held -= b.hi - b.lo
            if not blocks:
                del self._blocks[b.key]
            b.dropped = True
            if b.readers == 0:
                return [b]
        return []

    def reset(self) -> None:
        """Drop every block (the work stream restarts elsewhere: a resume, a new epoch)."""
        free: list[_Block] = []
        with self._lock:
            for blocks in self._blocks.values():
                for b in blocks:
                    b.future.cancel()
                    b.dropped = True
                    if b.readers == 0:
                        free.append(b)
            self._blocks.clear()
            self._of_item.clear()
            self._pending.clear()
            self._planned.clear()
            self._held = 0
            self._cold = True
        for b in free:
            self._recycle(b)

    def close(self) -> None:
        self._closed = True
        self.reset()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.buffers is not None:
            self.buffers.clear()


class ReadAheadStorage:
    """``storage`` with range reads served from a :class:`ReadAhead`'s blocks where they cover them."""

    def __init__(self, inner: Storage, ahead: ReadAhead):
        self.inner, self.ahead = inner, ahead
        self.url, self.is_local = inner.url, inner.is_local

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, key: str) -> bytes:
        self.ahead.counters.add(metadata_requests=1)
        return self.inner.get(key)

    def get_suffix(self, key: str, n: int) -> bytes:
        self.ahead.counters.add(metadata_requests=1)
        return self.inner.get_suffix(key, n)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def open_range(self, key: str, start: int, end: int) -> RangeReader:
        self.ahead.counters.add(bytes_decoded=end - start)
        got = self.ahead.lookup(key, start, end)
        if got is not None:
            return got
        self.ahead.counters.add(requests=1, direct_requests=1, bytes_fetched=end - start)
        return self.inner.open_range(key, start, end)

"""An ordered, byte-capped prefetch pool: a fixed set of reader threads over one work stream.

Readers take work items from ONE shared stream in order, produce each (read, decode, collate),
and put the result into a reorder buffer; the consumer takes results strictly in stream order.
A reader claims the next item only when its bytes fit under the cap, so the cap holds for
everything claimed and not yet consumed (work in flight included). A slow item delays only
itself: the other readers keep claiming the items after it. (The cap is exceeded only by a
single item larger than the whole cap, which is then produced alone.) An exception raised by
the stream or by producing an item reaches the consumer in its place in the order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar


class Sized(Protocol):
    nbytes: int  # host bytes the produced result will hold


T = TypeVar("T", bound=Sized)


@dataclass(frozen=True)
class Delivery(Generic[T]):
    """One produced item, as the consumer takes it."""

    item: T
    result: Any
    wait_s: float  # time the consumer waited for it
    ready_items: int  # items produced and waiting in the buffer after taking this one
    ready_bytes: int  # their bytes
    inflight_bytes: int  # bytes claimed by readers and not yet consumed (<= max_bytes)


class _Done(NamedTuple):
    item: Any  # None: the stream itself failed
    result: Any
    error: BaseException | None
    nbytes: int


class Prefetcher(Generic[T]):
    """Fixed reader pool over one ordered work stream, a byte-capped reorder buffer, in-order :meth:`get`.

    ``work(stop)`` returns the stream (it may block, e.g. waiting for new data, until ``stop`` is set);
    ``produce(item)`` runs in a reader thread."""

    def __init__(self, work: Callable[[threading.Event], Iterator[T]], produce: Callable[[T], Any],
                 num_readers: int, max_bytes: int, thread_name: str = "dflash-reader"):
        self._stop = threading.Event()
        self._work, self._produce, self._max_bytes = work(self._stop), produce, max_bytes
        self._work_lock = threading.Lock()
        self._cond = threading.Condition()
        self._ready: dict[int, _Done] = {}
        self._next_claim = self._next_deliver = 0
        self._reserved = self._ready_bytes = 0
        self.max_reserved = 0  # the most bytes ever claimed and not yet consumed
        self._exhausted = False
        self._threads = [threading.Thread(target=self._run, name=f"{thread_name}-{k}", daemon=True)
                         for k in range(num_readers)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            claimed = self._claim()
            if claimed is None:
                return
            seq, item = claimed
            result, err = None, None
            try:
                result = self._produce(item)
            except BaseException as e:  # delivered to the consumer in order
                err = e
            with self._cond:
                self._ready[seq] = _Done(item, result, err, item.nbytes)
                self._ready_bytes += item.nbytes
                self._cond.notify_all()

    def _claim(self) -> tuple[int, T] | None:
        with self._work_lock:  # holders claim in stream order; the others wait their turn
            if self._exhausted:
                return None
            try:
                item = next(self._work, None)
            except BaseException as e:
                self._finish(e)
                return None
            if item is None:
                self._finish(None)
                return None
            with self._cond:
                while (self._reserved and self._reserved + item.nbytes > self._max_bytes
                       and not self._stop.is_set()):
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return None
                seq = self._next_claim
                self._next_claim += 1
                self._reserved += item.nbytes
                self.max_reserved = max(self.max_reserved, self._reserved)
            return seq, item

    def _finish(self, err: BaseException | None) -> None:
        with self._cond:
            if err is not None:
                self._ready[self._next_claim] = _Done(None, None, err, 0)
                self._next_claim += 1
            self._exhausted = True
            self._cond.notify_all()

    def get(self) -> Delivery[T] | None:
        """The next item in stream order and its result (waiting for it); None once the stream has ended.
        An error raised for this item (or by the stream) is raised here, after the pool is closed."""
        t0 = time.perf_counter()
        with self._cond:
            while self._next_deliver not in self._ready:
                if self._exhausted and self._next_deliver >= self._next_claim:
                    return None
                self._cond.wait(0.5)
            done = self._ready.pop(self._next_deliver)
            self._next_deliver += 1
            self._reserved -= done.nbytes
            self._ready_bytes -= done.nbytes
            self._cond.notify_all()
            depth, ready_bytes, inflight = len(self._ready), self._ready_bytes, self._reserved
        if done.error is not None:
            self.close()
            raise done.error
        return Delivery(done.item, done.result, time.perf_counter() - t0, depth, ready_bytes, inflight)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)

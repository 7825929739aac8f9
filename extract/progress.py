"""The extraction progress bar: samples, tokens/s, ETA, bytes written, projected size (all ranks)."""

from __future__ import annotations

import json
import threading
import time

from tqdm import tqdm

from dflash_cache.runtime.dist import Distributed

_REFRESH_S = 1.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class SharedCounters:
    """Each rank publishes its counters to the job's key-value store; rank 0 reads everyone's (no collective,
    so no rank ever waits for another to draw the bar)."""

    def __init__(self, ctx: Distributed):
        self.ctx = ctx
        self._store = ctx.store

    def publish(self, counts: dict[str, float]) -> None:
        if self._store is not None:
            self._store.set(f"dflash-progress/{self.ctx.rank}", json.dumps(counts))

    def totals(self, own: dict[str, float]) -> dict[str, float]:
        out = dict(own)
        if self._store is None:
            return out
        for r in range(self.ctx.world_size):
            key = f"dflash-progress/{r}"
            if r == self.ctx.rank or not self._store.check([key]):
                continue
            for k, v in json.loads(self._store.get(key)).items():
                out[k] = out.get(k, 0) + v
        return out


class ExtractProgress:
    """Counters updated by the compute loop and writer threads; rank 0 draws the aggregated bar.

    ``samples`` counts input records done (computed, or dropped by the tokenizer's filters, or completed by
    another job), so that the bar ends at its total; the written bytes and the projected size come from the
    committed parts."""

    def __init__(self, ctx: Distributed, total_samples: int, enabled: bool = True):
        self.ctx = ctx
        self.counts = {"samples": 0.0, "tokens": 0.0, "bytes": 0.0, "committed_samples": 0.0, "done": 0.0}
        self._lock = threading.Lock()
        self._shared = SharedCounters(ctx)
        self._t0 = time.perf_counter()
        self._last = 0.0
        self.total = total_samples
        self.bar = tqdm(total=total_samples, unit="sample", dynamic_ncols=True, desc="extract",
                        disable=not enabled or ctx.rank != 0, mininterval=_REFRESH_S)

    def add(self, **delta: float) -> None:
        with self._lock:
            for k, v in delta.items():
                self.counts[k] += v

    def refresh(self, force: bool = False, draw: bool = True) -> dict[str, float]:
        """Publish this rank's counters; on rank 0 update (and draw) the bar. Returns the job's totals as known
        to this rank."""
        now = time.perf_counter()
        with self._lock:
            own = dict(self.counts)
        if not force and now - self._last < _REFRESH_S:
            return own
        self._last = now
        self._shared.publish(own)
        if self.ctx.rank != 0 or self.bar.disable:
            return own
        tot = self._shared.totals(own)
        self.bar.n = int(tot["samples"])
        elapsed = max(now - self._t0, 1e-9)
        per_sample = tot["bytes"] / tot["committed_samples"] if tot["committed_samples"] else 0.0
        self.bar.set_postfix_str(
            f"{tot['tokens'] / elapsed:,.0f} tok/s, written {human_bytes(tot['bytes'])}, "
            f"projected {human_bytes(per_sample * self.total)}", refresh=False,
        )
        if draw and self.bar.n < self.total:  # the final state is drawn once, by close()
            self.bar.refresh()
        return tot

    def finish(self) -> None:
        """This rank is done. Rank 0 keeps the bar live until every rank says so, then ends it at the job's
        totals (the other ranks go on to the final reduction, where rank 0 meets them)."""
        self.add(done=1.0)
        tot = self.refresh(force=True, draw=False)
        while self.ctx.rank == 0 and not self.bar.disable and tot.get("done", 0) < self.ctx.world_size:
            time.sleep(_REFRESH_S)
            tot = self.refresh(force=True)
        self.close()

    def close(self) -> None:
        """End the bar: its last state is printed once, by tqdm's close (which disables the bar: a second call
        does nothing)."""
        if not self.bar.disable:
            self.refresh(force=True, draw=False)
        self.bar.close()

"""Live mode (``loader.live``): following a cache that is still being extracted. When the readers have claimed
every batch of a plan window, :class:`LiveWindows` polls the committed parts and returns the newly committed
ones as the next window of the same epoch; with nothing new it waits, logging a status line, until new parts
come, the extraction is marked finished, or ``loader.live_timeout_s`` passes without a new part (then the
epoch ends).

With several ranks, rank 0 alone polls and decides each window (``agree``, e.g.
:meth:`~dflash_cache.runtime.dist.Distributed.decided_by_main`): every rank plans the same parts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_cache.errors import CacheError, ConfigError
from dflash_cache.protocols import ReadableCache
from train.config import LoaderConfig

log = logging.getLogger(__name__)

# (key, decide, stop) -> the value of rank 0's decide() for that key, on every rank (None once stop is set)
Agree = Callable[[str, Callable[[], Any], threading.Event], Any]


def extraction_finished(cache: ReadableCache) -> bool:
    """True once ``dflash-extract`` has finished writing ``cache``: its rank 0 writes the
    ``extract_report`` metadata document after every rank's last commit."""
    try:
        cache.read_metadata("extract_report")
    except CacheError:
        return False
    return True


class LiveWindows:
    """The parts of each next plan window of a growing cache.

    ``committed_keys()`` lists the committed parts now; ``training_samples(parts)`` counts the samples of
    ``parts`` a plan would train on; ``extraction_done()`` says whether the cache is finished."""

    def __init__(self, cfg: LoaderConfig, url: str, world_size: int, *,
                 committed_keys: Callable[[], list[str]], training_samples: Callable[[list[str]], int],
                 extraction_done: Callable[[], bool], agree: Agree | None = None,
                 on_wait: Callable[[], None] | None = None, logger: logging.Logger | None = None) -> None:
        if world_size > 1 and agree is None:
            raise ConfigError("loader.live with several ranks needs agree_parts, so that every rank plans the "
                              "same windows (e.g. Distributed.decided_by_main); or set loader.live = false")
        self.cfg, self.url, self.world_size = cfg, url, world_size
        self._committed_keys, self._training_samples = committed_keys, training_samples
        self._extraction_done = extraction_done
        self._agree: Agree = agree or (lambda key, decide, stop: decide())
        self.status = "idle"
        self.log = logger or log  # the loader passes its own: its status lines stay under its name
        self._on_wait = on_wait or (lambda: None)  # called per status line logged while waiting

    def next_window(self, epoch: int, windows: list[list[str]], stop: threading.Event) -> list[str] | None:
        """The parts of window ``len(windows)`` of ``epoch`` (decided once, by rank 0); None: the epoch ends."""
        return self._agree(f"live/e{epoch}/w{len(windows)}", lambda: self.poll(epoch, windows, stop), stop)

    def poll(self, epoch: int, windows: list[list[str]], stop: threading.Event) -> list[str] | None:
        """The parts committed since the last window, once they give every rank a batch; None: the epoch ends
        (extraction finished, ``loader.live_timeout_s`` without a new part, or ``stop``)."""
        seen = {k for w in windows for k in w}
        waited_since, last_log, n_new = time.monotonic(), 0.0, 0
        while True:
            new = [k for k in self._committed_keys() if k not in seen]
            if len(new) > n_new:  # a part arrived: the idle clock restarts
                waited_since, n_new = time.monotonic(), len(new)
            trainable = self._training_samples(new) if new else 0
            if trainable >= self.world_size:  # (a part of a few, or only held-out, samples waits for more)
                self.status = "reading"
                self.log.info("live: epoch %d window %d plans %d newly committed part(s) (%d in all)", epoch,
                         len(windows), len(new), len(seen) + len(new))
                return sorted(new)
            done = self._extraction_done()
            idle = time.monotonic() - waited_since
            timed_out = self.cfg.live_timeout_s is not None and idle >= self.cfg.live_timeout_s
            if done and not windows:
                raise CacheError(f"the cache at {self.url} has {trainable} training sample(s) for "
                                 f"{self.world_size} rank(s) and its extraction is marked finished; nothing to "
                                 "train on (extract more data or lower loader.holdout_fraction)")
            if done or timed_out:
                if new:
                    self.log.warning("live: %d newly committed part(s) hold %d training sample(s), too few to give each "
                                "of %d rank(s) a batch: epoch %d leaves them out (the next epoch plans them)",
                                len(new), trainable, self.world_size, epoch)
                if timed_out and not done:
                    self.log.warning("live: no new part for %.0f s (loader.live_timeout_s); ending epoch %d with %d "
                                "parts", idle, epoch, len(seen))
                return None
            self.status = f"waiting for new parts ({len(seen)} planned, extraction running)"
            if time.monotonic() - last_log >= max(30.0, self.cfg.live_poll_s) or last_log == 0.0:
                self.log.info("live: consumed everything committed so far; %s, waited %.0f s", self.status, idle)
                last_log = time.monotonic()
                self._on_wait()
            if stop.wait(self.cfg.live_poll_s):
                return None

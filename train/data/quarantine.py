"""Corrupt parts left out for the rest of a run (``loader.on_corrupt = skip``): the set of quarantined part
keys, shared by the reader threads, and what it removes from a planned batch. With ``on_corrupt = error`` the
first corrupt read is raised instead."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from dflash_cache.errors import CacheCorruptError

log = logging.getLogger(__name__)


class PartKeys(Protocol):
    """What the quarantine needs of a sample table: its parts, each with a ``key``, and each sample's part."""

    parts: Sequence
    part: Sequence


class Quarantine:
    """Quarantined part keys. Thread-safe: the readers add parts while the consumer reads the set.

    ``on_change(keys)`` is called with the sorted keys after each change, under the lock (keep it short: the
    loader stores the list in its counters)."""

    def __init__(self, on_corrupt: str, on_change: Callable[[list[str]], None] | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.skip = on_corrupt == "skip"
        self._keys: set[str] = set()
        self._lock = threading.Lock()
        self._on_change = on_change or (lambda keys: None)
        self.log = logger or log  # the loader passes its own: the warnings stay under its name

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)

    def add(self, err: CacheCorruptError) -> None:
        """Quarantine ``err.part`` (once; logged)."""
        with self._lock:
            if err.part is None or err.part in self._keys:
                return
            self._keys.add(err.part)
            n = len(self._keys)
            self._on_change(sorted(self._keys))  # under the lock: listeners see the sets in order
        self.log.warning("quarantined part %s for the rest of the run (loader.on_corrupt = skip; %d part(s) so far): %s",
                    err.part, n, err)

    def numbers_in(self, table: PartKeys) -> set[int]:
        """Numbers (into ``table.parts``) of the quarantined parts."""
        with self._lock:
            if not self._keys:
                return set()
            bad = set(self._keys)
        return {i for i, p in enumerate(table.parts) if p.key in bad}

    def drop(self, table: PartKeys, rows: list[list[int]]) -> tuple[list[list[int]], int]:
        """``rows`` (positions into ``table``) without the samples of quarantined parts, empty rows removed,
        and how many samples were left out."""
        bad = self.numbers_in(table)
        if not bad:
            return rows, 0
        kept = [[p for p in r if int(table.part[p]) not in bad] for r in rows]
        dropped = sum(len(r) for r in rows) - sum(len(r) for r in kept)
        return [r for r in kept if r], dropped

    def state_dict(self) -> list[str]:
        return self.keys()

    def load_state_dict(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._keys = set(keys)
            self._on_change(sorted(self._keys))

"""The loader's two helpers on their own: the quarantine of corrupt parts (``loader.on_corrupt = skip``) and
live mode's windows over a cache that is still growing."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_cache.errors import CacheCorruptError, CacheError, ConfigError
from train.config import LoaderConfig
from train.data.live import LiveWindows
from train.data.quarantine import Quarantine


def _table(keys: list[str], part_of_sample: list[int]) -> SimpleNamespace:
    return SimpleNamespace(parts=[SimpleNamespace(key=k) for k in keys], part=np.asarray(part_of_sample))


def test_quarantine_drops_the_samples_of_its_parts_and_keeps_its_state(caplog):
    seen: list[list[str]] = []
    q = Quarantine("skip", on_change=seen.append)
    table = _table(["p0", "p1", "p2"], [0, 0, 1, 1, 2, 2])
    rows = [[0, 2], [3], [4, 5]]
    assert q.drop(table, rows) == (rows, 0)  # nothing quarantined: nothing left out
    q.add(CacheCorruptError("bad crc", part="p1"))
    q.add(CacheCorruptError("bad crc again", part="p1"))  # once
    assert seen == [["p1"]] and "p1" in q and len(q) == 1
    assert "quarantined part p1" in caplog.text
    assert q.drop(table, rows) == ([[0], [4, 5]], 2)  # the row left empty is removed
    assert q.numbers_in(table) == {1}
    q.add(CacheCorruptError("torn", part="p0"))
    assert q.state_dict() == ["p0", "p1"] and seen[-1] == ["p0", "p1"]

    restored_seen: list[list[str]] = []
    restored = Quarantine("skip", on_change=restored_seen.append)
    restored.load_state_dict(q.state_dict())
    assert restored.keys() == ["p0", "p1"] and restored_seen == [["p0", "p1"]]
    assert restored.drop(table, rows) == ([[4, 5]], 3)
    assert Quarantine("error").skip is False and q.skip is True


def test_quarantine_is_safe_under_concurrent_adds():
    q = Quarantine("skip")
    threads = [threading.Thread(target=lambda i=i: [q.add(CacheCorruptError("x", part=f"p{(i * 7 + j) % 50}"))
                                                  for j in range(50)]) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert q.keys() == sorted(f"p{i}" for i in range(50))


def _live(committed, *, done=lambda: False, samples=len, world_size=1, agree=None, **cfg):
    waits = []
    lw = LiveWindows(LoaderConfig(live=True, live_poll_s=0.01, **cfg), "mem://c", world_size,
                     committed_keys=committed, training_samples=samples, extraction_done=done,
                     agree=agree, on_wait=lambda: waits.append(1))
    return lw, waits


def test_live_windows_return_newly_committed_parts_then_end_when_extraction_is_done():
    committed = [["a", "b"], ["a", "b"], ["a", "b", "c"]]  # c arrives on the third poll
    calls = iter(committed)
    lw, waits = _live(lambda: next(calls, ["a", "b", "c"]))
    stop = threading.Event()
    assert lw.poll(0, [], stop) == ["a", "b"] and lw.status == "reading"
    assert lw.poll(0, [["a", "b"]], stop) == ["c"]
    assert waits == [1] and lw.status == "reading"  # it waited once (logged) before c came
    finished, _ = _live(lambda: ["a"], done=lambda: True)
    assert finished.next_window(1, [["a"]], stop) is None  # nothing new and extraction finished: the epoch ends


def test_live_windows_refuse_a_finished_cache_with_nothing_to_train_and_time_out():
    stop = threading.Event()
    empty, _ = _live(lambda: [], done=lambda: True)
    with pytest.raises(CacheError, match="mem://c has 0 training sample"):
        empty.poll(0, [], stop)
    with pytest.raises(ConfigError, match="agree_parts"):
        _live(lambda: [], world_size=2)
    few, _ = _live(lambda: ["a", "tiny"], samples=lambda parts: 1, world_size=2, live_timeout_s=0.05,
                   agree=lambda key, decide, stop: decide())  # one process standing in for rank 0's decision
    t0 = time.monotonic()
    assert few.next_window(0, [["x"]], stop) is None  # too few samples for 2 ranks: waits, then times out
    assert time.monotonic() - t0 >= 0.05
    assert few.status.startswith("waiting for new parts")


def test_live_windows_stop_waiting_when_told():
    lw, _ = _live(lambda: [])
    stop = threading.Event()
    stop.set()
    assert lw.poll(0, [["x"]], stop) is None


def test_live_windows_ask_rank_zero_once_per_window():
    keys = []
    lw = LiveWindows(LoaderConfig(live=True), "mem://c", 2, committed_keys=lambda: ["a", "b"],
                     training_samples=len, extraction_done=lambda: False,
                     agree=lambda key, decide, stop: keys.append(key) or decide())
    assert lw.next_window(3, [["z"]], threading.Event()) == ["a", "b"]
    assert keys == ["live/e3/w1"]

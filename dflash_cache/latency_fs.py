"""``latency://`` -- local files behind a modelled object store: every request waits a fixed latency,
and each request streams at most ``mbps`` MB/s (a per-connection bandwidth cap, as one S3 stream).

For measuring the read path as an object store would serve it (``bench/bench_object_store.py``) and
for counting the requests it makes (tests), without a network. Configure with
:func:`configure` in this process (or ``DFLASH_LATENCY_MS`` / ``DFLASH_LATENCY_MBPS``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

PROTOCOL = "latency"
_listing = threading.local()


class _Model:
    latency_s = float(os.environ.get("DFLASH_LATENCY_MS", "0")) / 1000
    bytes_per_s = float(os.environ.get("DFLASH_LATENCY_MBPS", "0")) * 1e6  # 0: no cap
    lock = threading.Lock()
    requests = 0  # data requests (whole or ranged GETs)
    metadata_requests = 0  # HEAD/LIST-like requests
    bytes_read = 0
    in_flight = 0
    max_in_flight = 0  # the most data requests running at once
    by_kind: dict[str, int] = {}  # every request by what it reads (see _kind)


def _kind(path: str, verb: str) -> str:
    """``feature range`` (a range of a feature or scales shard, a shard index included), ``small array``
    (sample_ids, offsets, input_ids, loss_mask), ``commit record``, ``list``, ``head`` or ``other``
    (zarr.json documents, leases)."""
    if verb != "get":
        return verb
    if "/features/c/" in path or "/scales/c/" in path:
        return "feature range"
    if "/c/" in path:
        return "small array"
    return "commit record" if path.endswith("commit.json") else "other"


def _count(path: Any, verb: str) -> None:
    kind = _kind(str(path), verb)
    with _Model.lock:
        _Model.by_kind[kind] = _Model.by_kind.get(kind, 0) + 1


def configure(latency_ms: float, mbps: float) -> None:
    """Latency per request (ms) and bandwidth per request stream (MB/s; 0: unlimited)."""
    _Model.latency_s, _Model.bytes_per_s = latency_ms / 1000, mbps * 1e6


def counters() -> dict[str, Any]:
    return {"requests": _Model.requests, "metadata_requests": _Model.metadata_requests,
            "bytes_read": _Model.bytes_read, "max_in_flight": _Model.max_in_flight, "by_kind": dict(_Model.by_kind)}


def reset_counters() -> None:
    with _Model.lock:
        _Model.requests = _Model.metadata_requests = _Model.bytes_read = _Model.max_in_flight = 0
        _Model.by_kind = {}


def _wait(nbytes: int, started: float) -> None:
    budget = _Model.latency_s + (nbytes / _Model.bytes_per_s if _Model.bytes_per_s else 0.0)
    left = budget - (time.perf_counter() - started)
    if left > 0:
        time.sleep(left)


class _LatencyFile(LocalFileOpener):
    """A file opened for reading: each read (``read`` or ``readinto``, e.g. a whole or ranged GET) is one
    modelled request; opening and seeking are not."""

    def _request(self, read: Any, arg: Any) -> Any:
        t0 = time.perf_counter()
        with _Model.lock:
            _Model.in_flight += 1
            _Model.max_in_flight = max(_Model.max_in_flight, _Model.in_flight)
        try:
            _count(self.path, "get")
            out = read(arg)
            n = out if isinstance(out, int) else len(out)
            with _Model.lock:
                _Model.requests += 1
                _Model.bytes_read += n
            _wait(n, t0)
        finally:
            with _Model.lock:
                _Model.in_flight -= 1
        return out

    def read(self, size: int = -1) -> bytes:
        return self._request(self.f.read, size)

    def readinto(self, buf: Any) -> int:
        return self._request(self.f.readinto, buf)


class LatencyFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def _open(self, path: Any, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        if "r" not in mode:
            return super()._open(path, mode, block_size, **kwargs)
        return _LatencyFile(self._strip_protocol(path), mode, fs=self, **kwargs)

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        if getattr(_listing, "on", False):  # the local listing's own stat: part of the one LIST request
            return super().info(path, **kwargs)
        t0 = time.perf_counter()
        _count(path, "head")
        out = super().info(path, **kwargs)
        with _Model.lock:
            _Model.metadata_requests += 1
        _wait(0, t0)
        return out

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> list[Any]:
        t0 = time.perf_counter()
        _count(path, "list")
        _listing.on = True
        try:
            out = super().ls(path, detail=detail, **kwargs)
        finally:
            _listing.on = False
        with _Model.lock:
            _Model.metadata_requests += 1
        _wait(0, t0)
        return out


fsspec.register_implementation(PROTOCOL, LatencyFileSystem, clobber=True)

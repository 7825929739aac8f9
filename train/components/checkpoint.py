"""Non-blocking, atomic training checkpoints.

Layout of one committed checkpoint (``RUN/checkpoints/step-00000120/``)::

    model.safetensors   drafter state_dict (trainable + persistent weights; frozen head excluded);
                        metadata: "step" and, from the trainer, "dflash_config" (the drafter config JSON)
    state.safetensors   every other tensor of the training state (optimizer moments ...)
    state.json          the structure of the training state, tensors replaced by references
                        into state.safetensors (optimizer, scheduler, loader, guard, step ...)
    config.json         the resolved pipeline config of the run
    manifest.json       written LAST: step, cache fingerprint, size and crc32c of every file

Saving: :meth:`Checkpointer.save` copies the state to host memory on the calling thread (the
only part the training loop waits for) and serializes it on a background thread, into
``step-XXXXXXXX.tmp/``; files are fsynced, the manifest is written last, the directory is
renamed into place and its parent fsynced. At most one save is in flight; a second save waits
for the first. Older checkpoints beyond ``keep_last`` are deleted only after a newer one
committed. Nothing is ever loaded with a pickle-executing reader.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dflash_cache.codecs import crc32c
from dflash_cache.errors import DFlashError
from dflash_cache.runtime.switches import env_switch
from dflash_cache.storage import fsync_dir
from train.config import CheckpointConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
MODEL_FILE = "model.safetensors"
STATE_TENSORS_FILE = "state.safetensors"
STATE_JSON_FILE = "state.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{8})$")
# Test hook: seconds to sleep after each file the background writer writes, to widen the window in
# which a crash lands mid-save. Never set in production; read once per save.
WRITE_DELAY_ENV = "DFLASH_TEST_CKPT_WRITE_DELAY_S"


class CheckpointError(DFlashError):
    """A checkpoint is missing, torn or incompatible."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ----------------------------------------------------------------------------------------------
# Snapshot: nested state -> (JSON structure, flat CPU tensors). Runs on the training thread.
# ----------------------------------------------------------------------------------------------


class _Snapshotter:
    """Copies every tensor of a nested state to host memory; GPU copies go through pinned memory.

    ``pool`` holds the host buffers of the previous snapshot (free once its write finished):
    reusing them avoids page-faulting (or pinning) gigabytes of fresh memory on every save.
    """

    def __init__(self, pool: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.pool = pool if pool is not None else {}
        self._has_cuda = False

    def tensor(self, t: torch.Tensor, key: str) -> torch.Tensor:
        # a copy, always: the next optimizer step mutates parameters and moments in place
        t = t.detach()
        dst = self.pool.get(key)
        if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        self._has_cuda |= t.is_cuda
        dst.copy_(t, non_blocking=t.is_cuda)
        self.tensors[key] = dst
        return dst

    def encode(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, path)
            return {"__tensor__": path}
        if isinstance(obj, np.ndarray):
            self.tensors[path] = torch.from_numpy(np.array(obj, copy=True))
            return {"__ndarray__": path}
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: self.encode(v, f"{path}.{k}") for k, v in obj.items()}
            return {"__items__": [[k, self.encode(v, f"{path}.{k}")] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, bool | int | float | str):
            return obj
        raise TypeError(f"checkpoint state at {path!r}: cannot store a {type(obj).__name__}")

    def finish(self) -> None:
        if self._has_cuda:
            torch.cuda.synchronize()


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__items__"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


@dataclass
class Snapshot:
    """A training state copied to host memory, ready to be written by the background thread."""

    step: int
    model: dict[str, torch.Tensor]
    state_json: Any
    state_tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    cache_fingerprint: str | None
    model_metadata: dict[str, str] = field(default_factory=dict)  # safetensors metadata of model.safetensors


def take_snapshot(
    step: int,
    model_state: Mapping[str, torch.Tensor],
    state: Mapping[str, Any],
    config: dict[str, Any],
    cache_fingerprint: str | None,
    pool: dict[str, torch.Tensor] | None = None,
) -> Snapshot:
    """Copy ``model_state`` and the nested ``state`` to host memory (the training-thread part).

    ``pool``: host buffers that may be overwritten (a previous snapshot whose write has finished)."""
    snap = _Snapshotter(pool)
    model = {k: snap.tensor(v, "model/" + k) for k, v in model_state.items()}
    state_json = snap.encode(dict(state), "state")
    snap.finish()
    state_tensors = {k: v for k, v in snap.tensors.items() if not k.startswith("model/")}
    return Snapshot(step, model, state_json, state_tensors, config, cache_fingerprint)


def snapshot_buffers(snap: Snapshot) -> dict[str, torch.Tensor]:
    """The host buffers of ``snap`` under their pool keys (for reuse by the next snapshot)."""
    return {**{"model/" + k: v for k, v in snap.model.items()}, **snap.state_tensors}


# ----------------------------------------------------------------------------------------------
# Durable writes
# ----------------------------------------------------------------------------------------------


def _crc32c(data: bytes | memoryview) -> str:
    return f"{crc32c(data):08x}"  # the cache's checksum: no copy of a memoryview, fastest library present


def _write_durable(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32c": _crc32c(data)}



def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=False).encode()


def write_checkpoint(root: Path, snap: Snapshot) -> Path:
    """Write ``snap`` to ``root/step-N.tmp``, fsync, manifest last, rename to ``root/step-N``."""
    delay = float(env_switch(WRITE_DELAY_ENV, "0") or 0)
    final = root / step_dir_name(snap.step)
    tmp = root / (final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    blobs = {
        MODEL_FILE: lambda: st_save(snap.model, metadata={**snap.model_metadata, "step": str(snap.step)}),
        STATE_TENSORS_FILE: lambda: st_save(snap.state_tensors),
        STATE_JSON_FILE: lambda: _json_bytes(snap.state_json),
        CONFIG_FILE: lambda: _json_bytes(snap.config),
    }
    files: dict[str, Any] = {}
    for name, make in blobs.items():
        files[name] = _write_durable(tmp / name, make())
        if delay:
            time.sleep(delay)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": snap.step,
        "cache_fingerprint": snap.cache_fingerprint,
        "files": files,
        "created_unix": time.time(),
    }
    _write_durable(tmp / MANIFEST_FILE, _json_bytes(manifest))
    fsync_dir(tmp)
    if final.exists():  # a torn leftover of a lost future (we resumed from an earlier step)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    return final


# ----------------------------------------------------------------------------------------------
# Reading and validation
# ----------------------------------------------------------------------------------------------


def _read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_FILE}; the save did not complete. Use an older checkpoint.")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{mpath}: not valid JSON ({err}); the checkpoint is torn.") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: checkpoint format {manifest.get('format_version')!r}, this version reads "
            f"{FORMAT_VERSION}; use the dflash-pipeline version that wrote it."
        )
    return manifest


def _read_checked(path: Path, name: str, manifest: Mapping[str, Any]) -> bytes:
    """Read one file of a checkpoint and check its size and crc32c against the manifest."""
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{path}: {name} is not listed in the manifest")
    fpath = path / name
    if not fpath.is_file():
        raise CheckpointError(f"{path}: {name} is missing although the manifest lists it")
    data = fpath.read_bytes()
    found = {"bytes": len(data), "crc32c": _crc32c(data)}
    if found != {"bytes": expected["bytes"], "crc32c": expected["crc32c"]}:
        raise CheckpointError(
            f"{fpath}: expected {expected['bytes']} bytes with crc32c {expected['crc32c']}, found "
            f"{found['bytes']} bytes with crc32c {found['crc32c']}; the file is corrupt. "
            "Delete this checkpoint directory to resume from the previous one."
        )
    return data


def validate_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check the manifest and every file's checksum; return the manifest or raise CheckpointError."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name in manifest["files"]:
        _read_checked(path, name, manifest)
    return manifest


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Committed-looking checkpoint directories (renamed into place), oldest first. Not validated."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest checkpoint in ``run_dir`` whose manifest and checksums are valid, or None."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            validate_checkpoint(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", path, err)
            continue
        return path
    return None


def read_checkpoint_model(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """``(drafter state_dict, resolved config dict, manifest)`` of one checkpoint, checksums verified."""
    path = Path(path)
    manifest = _read_manifest(path)
    model = st_load(_read_checked(path, MODEL_FILE, manifest))
    config = json.loads(_read_checked(path, CONFIG_FILE, manifest))
    return model, config, manifest


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    state: dict[str, Any]
    config: dict[str, Any]
    manifest: dict[str, Any]


def read_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Everything in one checkpoint (model, decoded training state, config, manifest)."""
    path = Path(path)
    model, config, manifest = read_checkpoint_model(path)
    tensors = st_load(_read_checked(path, STATE_TENSORS_FILE, manifest))
    state_json = json.loads(_read_checked(path, STATE_JSON_FILE, manifest))
    state = _decode(state_json, tensors)
    return LoadedCheckpoint(path, int(manifest["step"]), model, state, config, manifest)


# ----------------------------------------------------------------------------------------------
# The checkpointer
# ----------------------------------------------------------------------------------------------


@dataclass
class SaveStats:
    step: int
    blocking_ms: float  # training-thread time: waiting for the previous save + snapshot
    wait_ms: float  # part of blocking_ms spent waiting for the previous save


@dataclass
class _Completed:
    step: int
    write_s: float
    path: Path


@dataclass
class _Worker:
    step: int
    thread: threading.Thread | None = None
    error: list[BaseException] = field(default_factory=list)


class Checkpointer:
    """Saves training state without blocking the loop on serialization; loads the latest valid one.

    ``is_writer=False`` (ranks other than 0) makes :meth:`save` a no-op, so a checkpoint is written
    once per run.
    """

    def __init__(
        self,
        run_dir: str | Path,
        cfg: CheckpointConfig,
        *,
        config: dict[str, Any] | None = None,
        cache_fingerprint: str | None = None,
        is_writer: bool = True,
        model_metadata: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.cfg = cfg
        self.config = config or {}
        self.cache_fingerprint = cache_fingerprint
        self.model_metadata = dict(model_metadata or {})  # e.g. the drafter config, for export without a cache
        self.is_writer = is_writer
        self._worker: _Worker | None = None
        self._completed: list[_Completed] = []
        self._lock = threading.Lock()
        self._pool: dict[str, torch.Tensor] = {}
        self.last_saved_step: int | None = None
        if is_writer:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int, model_state: Mapping[str, torch.Tensor], state: Mapping[str, Any]) -> SaveStats:
        """Snapshot now (blocking), write in the background. Waits for a save already in flight."""
        t0 = time.perf_counter()
        self.last_saved_step = step  # on every rank, so that all ranks take the same save decisions
        if not self.is_writer:
            return SaveStats(step, 0.0, 0.0)
        self._join()  # the previous write has finished: its host buffers can be reused
        t_wait = time.perf_counter()
        snap = take_snapshot(step, model_state, state, self.config, self.cache_fingerprint, pool=self._pool)
        snap.model_metadata = self.model_metadata
        self._pool = snapshot_buffers(snap)
        worker = _Worker(step)
        worker.thread = threading.Thread(target=self._write, args=(snap, worker), name=f"ckpt-{step}", daemon=True)
        self._worker = worker
        worker.thread.start()
        t1 = time.perf_counter()
        return SaveStats(step, (t1 - t0) * 1e3, (t_wait - t0) * 1e3)

    def _write(self, snap: Snapshot, worker: _Worker) -> None:
        t0 = time.perf_counter()
        try:
            path = write_checkpoint(self.root, snap)
            self._prune(keep_step=snap.step)
        except BaseException as err:  # surfaced on the training thread by the next save/wait
            worker.error.append(err)
            return
        with self._lock:
            self._completed.append(_Completed(snap.step, time.perf_counter() - t0, path))
        log.info("checkpoint step %d committed in %.2fs: %s", snap.step, time.perf_counter() - t0, path)

    def _join(self) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        assert worker.thread is not None
        worker.thread.join()
        if worker.error:
            raise CheckpointError(
                f"writing the checkpoint of step {worker.step} to {self.root} failed: {worker.error[0]!r}; "
                "check free disk space and permissions"
            ) from worker.error[0]

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise if it failed."""
        self._join()

    def pop_completed(self) -> list[tuple[int, float]]:
        """``(step, background write seconds)`` of the saves committed since the last call."""
        with self._lock:
            done, self._completed = self._completed, []
        return [(c.step, c.write_s) for c in done]

    def close(self) -> None:
        self.wait()

    # -- housekeeping -----------------------------------------------------------------------

    def _remove_leftovers(self) -> None:
        for p in self.root.glob("step-*.tmp"):
            log.info("removing an incomplete checkpoint left by an interrupted save: %s", p)
            shutil.rmtree(p, ignore_errors=True)

    def _prune(self, keep_step: int) -> None:
        """Delete the oldest checkpoints beyond keep_last (only ones older than the just-committed)."""
        committed = [(s, p) for s, p in list_checkpoints(self.root.parent) if s <= keep_step]
        for _, path in committed[: max(0, len(committed) - self.cfg.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)
        fsync_dir(self.root)

    # -- loading ----------------------------------------------------------------------------

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest valid checkpoint in the run, or None. Torn or corrupt ones are skipped."""
        path = find_latest(self.root.parent)
        return None if path is None else read_checkpoint(path)

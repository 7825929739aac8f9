"""The unit the loader hands the trainer: one token-budget batch from one bucket.

Rows are either one sample each, padded to the longest sample in the batch, or (with
``loader.packing``) several samples packed back to back. ``doc_ids`` tells the model where
each document starts and ends in its row, so a mask built from it never lets one document
see another; ``position_ids`` restart at 0 for each document.

The loader builds batches in reusable host buffers (:class:`BatchBufferPool`): a buffer is refilled
only once no tensor of the batch it held is alive and its device copy has completed.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

_TENSOR_FIELDS = ("features", "input_ids", "loss_mask", "doc_ids", "position_ids", "sample_ids")


@dataclass
class Batch:
    features: Tensor  # [R, T, n*H] bf16
    input_ids: Tensor  # [R, T] int64 (pad 0)
    loss_mask: Tensor  # [R, T] bool (False on padding)
    doc_ids: Tensor  # [R, T] int32: document index within its row, -1 on padding
    position_ids: Tensor  # [R, T] int64, restarting at 0 for each document (0 on padding)
    sample_ids: Tensor  # [S] int64, in row-major order (row 0's documents first)
    bucket: int
    epoch: int
    index: int  # batch index within the epoch on this rank
    n_tokens: int  # real (non-padding) tokens
    n_padded: int  # padding slots: R * T - n_tokens
    seed: int  # deterministic from (seed, epoch, index, rank): anchor sampling uses it

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def padding_fraction(self) -> float:
        total = self.n_tokens + self.n_padded
        return self.n_padded / total if total else 0.0

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        """Copy every tensor to ``device``. With pinned host tensors and ``non_blocking`` the
        copy is asynchronous with respect to the host (issue it on a side stream to keep it
        off the compute stream)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TENSOR_FIELDS}
        return replace(self, **moved)

    def pin_memory(self) -> Batch:
        """Page-locked copies of the tensors (only meaningful when a CUDA device exists)."""
        if not torch.cuda.is_available():
            return self
        pinned = {name: getattr(self, name).pin_memory() for name in _TENSOR_FIELDS}
        return replace(self, **pinned)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in _TENSOR_FIELDS))

    def equal(self, other: Batch) -> bool:
        """Bitwise equality of every tensor and every scalar field."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, Tensor):
                if a.dtype != b.dtype or a.shape != b.shape:
                    return False
                if not torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.int16) if b.dtype == torch.bfloat16 else b):
                    return False
            elif a != b:
                return False
        return True


# ---- reusable host memory for batches --------------------------------------------------------------

# (name, dtype) of the padded [R, T(, D)] tensors a batch is made of, in buffer order (widest alignment first)
_LAYOUT = (("features", torch.bfloat16), ("input_ids", torch.int64), ("position_ids", torch.int64),
           ("doc_ids", torch.int32), ("loss_mask", torch.bool))
_ALIGN = 64


def padded_nbytes(rows: int, seq_len: int, feature_dim: int) -> int:
    """Bytes of one batch's padded tensors laid out by :func:`carve_batch`."""
    total = 0
    for name, dtype in _LAYOUT:
        n = rows * seq_len * (feature_dim if name == "features" else 1) * dtype.itemsize
        total += -(-n // _ALIGN) * _ALIGN
    return total


def carve_batch(flat: Tensor, rows: int, seq_len: int, feature_dim: int) -> dict[str, Tensor]:
    """Views of a flat uint8 buffer as the padded batch tensors (uninitialised): features [R, T, D]
    bf16, input_ids [R, T] int64, position_ids [R, T] int64, doc_ids [R, T] int32, loss_mask [R, T] bool."""
    out, pos = {}, 0
    for name, dtype in _LAYOUT:
        shape = (rows, seq_len, feature_dim) if name == "features" else (rows, seq_len)
        n = rows * seq_len * (feature_dim if name == "features" else 1) * dtype.itemsize
        out[name] = flat[pos:pos + n].view(dtype).view(shape)
        pos += -(-n // _ALIGN) * _ALIGN
    return out


def host_buffer(nbytes: int, pin: bool) -> Tensor:
    """A flat uint8 host tensor. Unpinned memory comes from numpy, whose large allocations are backed by
    transparent huge pages: first-touch page faults, not copies, dominate filling fresh memory here."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


class _Slot:
    """Host memory owned by the pool, handed out as tensors with a storage of their own.

    Each :meth:`take` wraps the slot's memory in a new tensor (``torch.from_numpy``), whose storage dies only
    when the last tensor viewing it does (batch tensors, views of them, numpy arrays of them); a finalizer on
    that storage marks the slot free again. Pinned slots keep a page-locked tensor alive and wrap the same
    memory, so the tensors handed out are pinned too."""

    def __init__(self, nbytes: int, pin: bool):
        self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pin else None
        self.memory = self._pinned.numpy() if pin else np.empty(nbytes, dtype=np.uint8)
        self.busy = False
        self.event: Any = None  # CUDA event of the last device copy out of it

    @property
    def nbytes(self) -> int:
        return int(self.memory.nbytes)

    def take(self, nbytes: int) -> Tensor:
        flat = torch.from_numpy(self.memory[:nbytes])
        self.busy = True
        weakref.finalize(flat.untyped_storage(), self._release)
        return flat

    def _release(self) -> None:
        self.busy = False

    def contains(self, ptr: int) -> bool:
        base = self.memory.ctypes.data
        return base <= ptr < base + self.nbytes

    def is_free(self) -> bool:
        if self.busy:
            return False  # some tensor (a batch, a view of one, a numpy array of one) still uses it
        if self.event is not None:
            if not self.event.query():
                return False  # an asynchronous copy to the device may still be reading it
            self.event = None
        return True


class BatchBufferPool:
    """Host memory for batches, reused instead of allocated fresh for every batch.

    A buffer is reused only when nothing uses it any more: no tensor viewing it is alive (the storage of
    the tensor it was handed out as has been freed) and the last device copy out of it has completed (see
    :meth:`record_copy`). So a consumer that keeps batches keeps them intact; the pool then allocates
    fresh memory. At most ``max_slots`` buffers are kept; beyond that batches get unpooled memory.
    """

    def __init__(self, slot_bytes: int, max_slots: int, pin: bool = False):
        self.slot_bytes, self.max_slots, self.pin = slot_bytes, max_slots, pin
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self.reused = self.allocated = 0

    def take(self, nbytes: int) -> Tensor:
        """A flat uint8 tensor of ``nbytes`` (uninitialised)."""
        with self._lock:
            for slot in self._slots:
                if slot.nbytes >= nbytes and slot.is_free():
                    self.reused += 1
                    return slot.take(nbytes)  # taken under the lock: the slot is busy now
            self.allocated += 1
            if len(self._slots) >= self.max_slots or nbytes > self.slot_bytes:
                return host_buffer(nbytes, self.pin)
            slot = _Slot(self.slot_bytes, self.pin)
            self._slots.append(slot)
            return slot.take(nbytes)

    def batch_tensors(self, rows: int, seq_len: int, feature_dim: int) -> dict[str, Tensor]:
        flat = self.take(padded_nbytes(rows, seq_len, feature_dim))
        return carve_batch(flat, rows, seq_len, feature_dim)

    def record_copy(self, tensor: Tensor, event: Any) -> None:
        """``event`` completes when the device copy out of ``tensor`` (a batch tensor) has finished."""
        ptr = tensor.data_ptr()
        with self._lock:
            for slot in self._slots:
                if slot.contains(ptr):
                    slot.event = event
                    return

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()

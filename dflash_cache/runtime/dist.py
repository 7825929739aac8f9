"""One distributed set-up for both stages: the launcher's environment, the process group, the device.

``torchrun`` and ``accelerate launch`` start one process per GPU (or per CPU slot) and describe the job
in the same environment variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
(plus ``MASTER_ADDR``/``MASTER_PORT`` for the rendezvous). :func:`launcher_env` is the only place that
reads them; :meth:`Distributed.start` joins the process group (``gloo`` on CPU; ``nccl`` for CUDA
tensors with ``gloo`` beside it for CPU objects), pins the process to its GPU, and keeps the
rendezvous key-value store (rank 0 reads the other ranks' progress counters from it).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .launcher import LauncherEnv, check_launcher_env, launcher_env  # noqa: F401 - torch-free, re-exported here

log = logging.getLogger(__name__)

# A collective waits at most this long for the slowest rank. Long on purpose: extraction ranks reach
# the final reduction after their last unit, which can be hours apart on unequal hardware or data,
# and torchrun / accelerate already tear the group down when a rank dies.
COLLECTIVE_TIMEOUT = timedelta(hours=24)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


@dataclass
class Distributed:
    """This process's place in the job and the collectives both stages use."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    store: Any = None  # the rendezvous key-value store (None for a single process)
    _initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    @classmethod
    def start(cls, use_cuda: bool | None = None, collective_timeout: timedelta | None = None) -> Distributed:
        """Join the launcher's process group (if any) and pick this process's device.

        ``use_cuda``: None = CUDA when available. With CUDA the process is pinned to GPU
        ``LOCAL_RANK % device_count`` (several processes may share a node's GPUs).
        ``collective_timeout``: how long a collective waits for the slowest rank (default
        :data:`COLLECTIVE_TIMEOUT`)."""
        env = launcher_env()
        cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        device = torch.device("cpu")
        if cuda:
            device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        d = cls(env.rank, env.world_size, env.local_rank, env.local_world_size, device)
        if env.world_size > 1 and not dist.is_initialized():
            # the rendezvous the launcher prepared (env://); its store is kept for the progress counters
            store, rank, world = next(dist.rendezvous("env://", timeout=COLLECTIVE_TIMEOUT))
            store.set_timeout(COLLECTIVE_TIMEOUT)
            backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
            # the same key prefix init_process_group(init_method="env://") would use
            dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                    world_size=world, timeout=collective_timeout or COLLECTIVE_TIMEOUT)
            d.store, d._initialized_here = store, True
        return d

    def describe(self) -> str:
        """One line for the start-up log: world size, backend, and the device of every rank with its host.

        A collective (every rank calls it at the same point), so that rank 0, the one that logs, names the
        devices of all ranks: ``world size 2 (2 per node), backend gloo, devices: node-a: rank 0 cpu, rank 1 cpu``."""
        if not self.enabled:
            return f"world size 1 (one process, no process group), device {_device_name(self.device)}"
        here = (socket.gethostname(), self.rank, _device_name(self.device))
        by_host: dict[str, list[str]] = {}
        for host, rank, device in sorted(self.gather_objects(here), key=lambda t: t[1]):
            by_host.setdefault(host, []).append(f"rank {rank} {device}")
        devices = "; ".join(f"{host}: {', '.join(ranks)}" for host, ranks in by_host.items())
        return (f"world size {self.world_size} ({self.local_world_size} per node), backend {dist.get_backend()}, "
                f"devices: {devices}")

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def gather_objects(self, value: Any) -> list[Any]:
        """``value`` of every rank, indexed by rank (a collective: every rank calls it at the same point).
        Only for small JSON-able states of our own processes."""
        if not self.enabled:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` on every rank."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def decided_by_main(self, key: str, decide: Callable[[], Any], stop: threading.Event | None = None,
                        poll_s: float = 0.1) -> Any:
        """Rank 0's ``decide()`` (a JSON-able value) on every rank, agreed once per ``key``.

        Safe from any thread, unlike :meth:`broadcast_object`: the value goes through the rendezvous store,
        not a collective, so it cannot interleave with the training thread's collectives, and a rank that is
        told to ``stop`` while waiting returns None instead of blocking in a collective its peers left."""
        if not self.enabled:
            return decide()
        if self.store is None:
            raise ConfigError("ranks can agree only through the rendezvous store of Distributed.start(), but the "
                              "process group was initialised elsewhere; start the job with torchrun or "
                              "accelerate launch and let the command join the group")
        name = f"dflash/decided/{key}"
        if self.is_main:
            value = decide()
            self.store.set(name, json.dumps(value))
            return value
        while not self.store.check([name]):
            if stop is not None and stop.wait(poll_s):
                return None
            if stop is None:
                time.sleep(poll_s)
        return json.loads(self.store.get(name))

    def sum_counts(self, counts: dict[str, float]) -> dict[str, float]:
        """Element-wise sum of ``counts`` over ranks (same keys on every rank)."""
        if not self.enabled:
            return dict(counts)
        keys = sorted(counts)
        t = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(t)
        return dict(zip(keys, t.cpu().tolist(), strict=True))

    def max_int(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (returns it)."""
        if self.enabled:
            dist.all_reduce(t)
        return t

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def leave_together(self, timeout: timedelta) -> None:
        """Wait until every rank has finished its work, then let rank 0 (the host of the rendezvous store) go last.

        Called on a clean finish, just before :meth:`close`: without it a rank that finished first tears down its
        process group while rank 0 is still committing the last checkpoint over the same connections. Through the
        store, not a collective, so it cannot interleave with one; a peer that is gone ends the wait at once (its
        store calls fail), and ``timeout`` bounds a peer that hangs. Never raises: the run is already saved."""
        if not self.enabled or self.store is None:
            return
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            self.store.set(f"dflash/finished/{self.rank}", "1")
            self.store.wait([f"dflash/finished/{r}" for r in others], timeout)
            if self.is_main:  # the store dies with this process: the others leave first
                self.store.wait([f"dflash/left/{r}" for r in others], min(timeout, timedelta(seconds=60)))
            else:
                self.store.set(f"dflash/left/{self.rank}", "1")
        except Exception as err:  # noqa: BLE001 -- a peer or the store's host is gone; leave anyway
            log.warning("rank %d: leaving without the other ranks (%s)", self.rank, str(err).splitlines()[0][:200])

    def close(self) -> None:
        """Leave the process group if this object joined it."""
        if self._initialized_here and dist.is_initialized():
            dist.destroy_process_group()
        self._initialized_here = False

"""CPU thread budget for the compute thread pool.

On a CPU-only machine torch's intra-op pool defaults to one thread per core. When our own worker
threads (cache readers, part writers) or other processes of the same job also need those cores, the
pool's threads contend with them and a step runs several times slower (measured: a tiny-teacher forward
18x slower with 2 intra-op threads than with 1 on a busy 2-core machine). So each process takes its
share of the cores and leaves its workers theirs, unless the user chose (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def budget_cpu_threads(device: torch.device | str, worker_threads: int = 0, processes: int = 1) -> int:
    """Set torch's intra-op threads to this process's share of the cores (``cores // processes``) minus
    ``worker_threads`` (>= 1) for CPU compute; returns the count.

    Does nothing on a GPU device or when ``OMP_NUM_THREADS`` is set (the user's choice wins)."""
    if torch.device(device).type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    share = max(1, available_cores() // max(1, processes))
    n = max(1, share - worker_threads)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
        log.info("CPU compute: %d intra-op thread(s) per process (%d process(es), %d worker thread(s) each; "
                 "set OMP_NUM_THREADS to choose)", n, processes, worker_threads)
    return n

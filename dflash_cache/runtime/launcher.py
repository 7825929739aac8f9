"""Checks of the launcher's environment that need no torch (run before a command parses its arguments)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError


def check_launcher_env(env: Mapping[str, str] | None = None) -> None:
    """Refuse a launch that asked for several processes but gives this one no rank.

    ``accelerate launch --cpu --num_processes N`` (N > 1) sets MASTER_ADDR/PORT but neither RANK nor
    WORLD_SIZE: it starts one process, or leaves the ranks to mpirun's variables (``--mpirun_hostfile``),
    which the commands do not read; each process would run the whole job as if alone.
    """
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1") and "MASTER_ADDR" in env \
            and "WORLD_SIZE" not in env:
        raise ConfigError(
            "launched by `accelerate launch --cpu` with several processes, but this process has no RANK/WORLD_SIZE "
            "(accelerate starts one process on CPU, or leaves the ranks to mpirun): it would run the whole job "
            "alone. For N CPU processes use `accelerate launch --multi_gpu --num_processes N ...` (torchrun's "
            "launcher; runs on CPU with gloo) or `torchrun --nproc-per-node N ...`; for one process drop "
            "--num_processes. See docs/launchers.md"
        )


@dataclass(frozen=True)
class LauncherEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def launcher_env() -> LauncherEnv:
    """The job as ``torchrun`` / ``accelerate launch`` describe it (a single process when absent)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return LauncherEnv(
        rank=int(env.get("RANK", "0")),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )

"""Every ``DFLASH_*`` environment switch, in one place.

Settings a user chooses live in the config (TOML + ``--set``). The few switches below are for where a
config does not reach (the built-in teacher's location) or must not (test hooks and benchmark-only
speed switches). Code reads them only through :func:`env_switch`, so an unregistered name is a bug,
and the table at the end of ``docs/config.md`` is generated from this one (``make docs``; the test suite
fails when they differ).
"""

from __future__ import annotations

import os

SWITCHES: dict[str, str] = {
    "DFLASH_HOME": "Directory where built-in tiny teachers are built on first use "
                   "(default: `$XDG_CACHE_HOME/dflash-pipeline`, i.e. `~/.cache/dflash-pipeline`).",
    "DFLASH_CACHE_FSYNC": "`0` skips fsync of cache files: commits stay atomic but are not durable across a "
                          "power loss. For benchmarks and scratch caches only.",
    "DFLASH_CACHE_ENCODE_THREADS": "Threads that compress the inner chunks of a shard when writing "
                                   "(default: min(4, CPU count)).",
    "DFLASH_CACHE_BLOSC_GETITEM": "`0` decodes a partial chunk range by decoding the whole chunk through "
                                  "numcodecs' public API instead of blosc's `blosc_getitem` (for comparison "
                                  "benchmarks, or a numcodecs build where the latter misbehaves).",
    "DFLASH_CACHE_CRC": "`google` forces the `google-crc32c` checksum library even when the faster "
                        "`crc32c` package (the `fast` extra) is installed. Both compute the same values.",
    "DFLASH_HOST_ID": "This process's host identity in lock records: part leases, the run dir's and the answer "
                      "log's lock (default: the hostname). Processes with "
                      "another identity count as another host: their leases are alive by heartbeat, not by "
                      "pid (e.g. two nodes on one machine, or tests). `dflash-cache release --host` names it.",
    "DFLASH_TEST_CKPT_WRITE_DELAY_S": "Test hook: seconds the checkpoint writer sleeps after each file, to "
                                      "widen the window in which a kill lands mid-save. Never set in production.",
    "DFLASH_TEST_COMMIT_DELAY_S": "Test hook: seconds a part writer sleeps inside its commit (data written, "
                                  "commit record not yet), so a kill can be aimed at it. Never set in production.",
    "DFLASH_TEST_EVAL_DELAY_S": "Test hook: seconds each periodic held-out evaluation of `dflash-train` sleeps "
                                "(counted in `eval/seconds`), so a kill can be aimed at it. Never set in production.",
    "DFLASH_TEST_FAULTS": "Test and drill hook: a JSON object `{\"nan_steps\": [...], \"spike_steps\": [...], "
                          "\"spike_scale\": 1e6}`; the loss of the listed training steps becomes NaN or is "
                          "multiplied before backward, on the real code path (exercises the guards). "
                          "Never set in production.",
}


def env_switch(name: str, default: str | None = None) -> str | None:
    """The value of a registered ``DFLASH_*`` switch (``default`` when unset)."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a registered DFLASH_* switch; add it to dflash_cache.runtime.switches")
    return os.environ.get(name, default)

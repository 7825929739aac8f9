"""Multi-node safety: every rank resumes from the same step of the same run, and a rank that dies or
hangs is named when a collective gives up on it (after ``train.collective_timeout_s``, not 24 h).

The run dir must be on storage that every node sees: rank 0 writes the checkpoints and every rank
reads the one it resumes from. Node-local run dirs would resume the ranks at different steps (and
train with a wrong loss); :func:`agree_on_resume` refuses that before the first step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from typing import Any

from dflash_cache.errors import DFlashError
from dflash_cache.runtime.dist import Distributed

log = logging.getLogger(__name__)

_ALIVE = "dflash/train-alive"


def run_fingerprint(config: dict[str, Any], cache_fingerprint: str) -> str:
    """A short digest of the resolved config and the cache: equal on every rank of one run."""
    raw = json.dumps({"config": config, "cache": cache_fingerprint}, sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:12]


class ResumeDisagreementError(DFlashError):
    """The ranks would start from different steps or different runs."""


def agree_on_resume(d: Distributed, step: int, fingerprint: str, run_dir: Any) -> None:
    """All ranks compare the step they would resume from and the run fingerprint; refuse on any
    difference (a collective: every rank calls it before loading anything)."""
    if not d.enabled:
        return
    views = d.gather_objects({"step": int(step), "run": fingerprint, "host": socket.gethostname()})
    first = views[0]
    if all(v["step"] == first["step"] and v["run"] == first["run"] for v in views):
        return
    listing = "; ".join(f"rank {r} on {v['host']}: step {v['step']}, run {v['run']}" for r, v in enumerate(views))
    raise ResumeDisagreementError(
        f"the ranks disagree on where to resume ({listing}). Every rank must read the same run dir {run_dir}: put "
        "it on storage that every node sees (a shared file system), and launch every node with the same config "
        "and cache")


class RankWatch:
    """Each rank notes in the rendezvous store its last finished step and, from a daemon thread, that it
    is alive; when a collective times out, :meth:`explain` names the ranks that stopped reporting (dead,
    frozen or stalled nodes), else those behind."""

    def __init__(self, d: Distributed, timeout_s: float):
        self.d, self.timeout_s = d, timeout_s
        self.host = socket.gethostname()
        self.interval_s = max(0.5, min(10.0, timeout_s / 6))
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if d.enabled and d.store is not None:
            self._note()
            self._thread = threading.Thread(target=self._run, name="dflash-rank-alive", daemon=True)
            self._thread.start()

    def beat(self, step: int) -> None:
        self.step = step

    def close(self) -> None:
        """Stop noting, and wait until the thread has left the store: a daemon thread still inside a store call
        when the interpreter exits aborts the process ("terminate called without an active exception", SIGABRT)
        after the run has finished cleanly."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=2 * self.interval_s + 5)
        if thread.is_alive():  # the store call hangs: its host is gone; the exit may abort, the run is saved
            log.warning("the rank-alive thread is still in a rendezvous-store call after %.0f s; exiting anyway",
                        2 * self.interval_s + 5)

    def _note(self) -> None:
        try:
            self.d.store.set(f"{_ALIVE}/{self.d.rank}", json.dumps({"step": self.step, "t": time.time(),
                                                                     "host": self.host}))
        except Exception as err:  # noqa: BLE001 -- the store's host is gone: the collective will say so
            log.debug("could not note progress in the rendezvous store: %s", err)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._note()

    def explain(self, err: BaseException) -> DFlashError | None:
        """A one-line error for a collective that timed out (None: ``err`` is not such a timeout)."""
        text = str(err).lower()
        if not self.d.enabled or not any(s in text for s in ("timed out", "timeout", "connection closed",
                                                             "connection reset")):
            return None
        self._stop.set()  # (no join here: the error is named first; train() closes the watch on its way out)
        seen = {}
        try:
            for r in range(self.d.world_size):
                key = f"{_ALIVE}/{r}"
                if self.d.store is not None and self.d.store.check([key]):
                    seen[r] = json.loads(self.d.store.get(key))
        except Exception:  # noqa: BLE001 -- the store lives on rank 0's node: it is gone
            return DFlashError(f"rank {self.d.rank}: a collective gave up after {self.timeout_s:.0f} s "
                               "(train.collective_timeout_s) and the rendezvous store is unreachable: rank 0's node "
                               "died or hangs. Restart the job: it resumes from the last checkpoint")
        now = time.time()
        others = [r for r in range(self.d.world_size) if r != self.d.rank]
        silent = [r for r in others if r not in seen or now - seen[r]["t"] > 3 * self.interval_s]
        if not silent:
            low = min((seen[r]["step"] for r in others), default=0)
            silent = [r for r in others if seen[r]["step"] == low]
        names = ", ".join(
            f"rank {r}" + (f" on {seen[r]['host']} (last step {seen[r]['step']}, last heard {now - seen[r]['t']:.0f} s "
                           "ago)" if r in seen else " (never reported)") for r in silent)
        return DFlashError(f"rank {self.d.rank}: a collective waited {self.timeout_s:.0f} s (train.collective_timeout_s)"
                           f" for {names}: it died or hangs. Stop the job, check that node, and restart: it resumes "
                           "from the last checkpoint")

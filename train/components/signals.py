"""SIGTERM/SIGINT: finish the step, save a checkpoint, stop with exit code 128+N (rerun to resume).

A repeated signal while stopping does not cut the checkpoint short: repeated SIGTERMs are logged and
ignored; a third Ctrl-C (SIGINT) stops at once, without the checkpoint (as SIGKILL does)."""

from __future__ import annotations

import logging
import signal
from typing import Any

from dflash_cache.errors import DFlashError
from dflash_cache.runtime.dist import Distributed

log = logging.getLogger(__name__)


class TrainingInterrupted(DFlashError):
    """SIGINT/SIGTERM: the run saved a checkpoint and stopped; rerunning the command resumes."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class SignalFlag:
    """Turns SIGTERM/SIGINT into a flag the loop checks after each step (then saves and stops)."""

    def __init__(self, enabled: bool) -> None:
        self.signum: int | None = None
        self._repeats = 0  # further SIGINTs after the first signal
        self._previous: dict[int, Any] = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            log.warning("received %s: saving a checkpoint after this step", name)
            self.signum = signum
            return
        # already stopping: a repeated signal (schedulers often signal twice: the job step and the process)
        # never interrupts the checkpoint the first one promised. Only a third Ctrl-C stops at once.
        self._repeats += signum == signal.SIGINT
        if self._repeats >= 2:
            raise KeyboardInterrupt
        log.warning("received %s again: already stopping; the checkpoint is saved first, then the run exits "
                    "(SIGKILL, or Ctrl-C once more, stops at once without it)", name)

    def agreed(self, d: Distributed) -> int | None:
        """The stop signal, agreed by all ranks (a signal seen by any rank stops all at the same step)."""
        return d.max_int(self.signum or 0) or None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

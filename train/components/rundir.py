"""The run directory: a writable directory held by one trainer at a time.

:meth:`RunDir.claim` (rank 0; the other ranks learn the outcome) creates the directory, checks that it
can be written, and takes ``RUN/trainer.lock``:

- an exclusive ``flock`` on the file (released by the kernel when the holder dies, so the lock of a
  crashed or SIGKILLed trainer is free again at once);
- a holder record in the same file (PID, host, start time, a heartbeat refreshed every
  ``HEARTBEAT_S`` seconds, and ``released`` once the trainer ended), so a refusal names the holder.

Shared filesystems: ``flock`` is coherent across hosts on NFS (Linux maps it to NFS byte-range locks)
and on most cluster filesystems, but some mount it node-local (Lustre ``-o localflock``) or not at all.
So a record naming another host, not released, is trusted over a granted ``flock``: the second trainer
watches it for ``STALE_AFTER_S`` seconds of its own clock (hosts' clocks differ); if the heartbeat
advances, the holder is alive (refused), if not, its node is gone (taken over, logged). A record whose
heartbeat is far older than that by any plausible clock is taken over at once. Where ``flock`` is
unsupported, a record of this host is checked by PID and process start time instead.

The holder record, the host identity (the hostname, or ``DFLASH_HOST_ID``), the pid check, the
heartbeat thread and the flock itself are the shared lock primitives of :mod:`dflash_cache.locks`.

Everything a trainer writes into the run dir goes through :func:`write_error` when the operating system
refuses it (read-only, permissions, no space), so the user sees the path and what to do, not a traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from dflash_cache.errors import DFlashError
from dflash_cache.locks import FlockFile, Heartbeat, HolderRecord, heartbeat_advances, host_name
from dflash_cache.runtime.dist import Distributed

log = logging.getLogger(__name__)

LOCK_FILE = "trainer.lock"
CONFIG_FILE = "config.json"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0  # six missed heartbeats: the holder (or its node) is gone
_RECORD_BYTES = 2048  # the record is rewritten in place, padded to this size (the flock'ed inode must stay)


class RunDirError(DFlashError):
    """The run dir cannot be used: not a directory, not writable, full, or held by another trainer."""


def write_error(path: str | Path, err: OSError, what: str = "write") -> RunDirError:
    """A user-facing error for an OS error while writing ``path`` (the cause first, then what to do)."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = ("free space (or quota) on that filesystem, then rerun the same command: the run resumes from its "
               "last checkpoint")
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "make the run dir writable for this user, or choose another --run-dir"
    elif err.errno in (errno.ENOTDIR, errno.EEXIST):
        fix = "--run-dir must be a directory (it is created if missing); choose another path"
    else:
        fix = "check the filesystem, or choose another --run-dir"
    return RunDirError(f"cannot {what} {path}: {err.strerror or err} (errno {err.errno}); {fix}")


@dataclass
class Holder(HolderRecord):
    """Who holds a run dir (the content of ``RUN/trainer.lock``): a lock holder record plus these."""

    started_unix: float = 0.0
    argv: list[str] = field(default_factory=list)
    released: bool = False

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_unix))
        return f"PID {self.pid} on host {self.host} (started {since}, command: {' '.join(self.argv) or '?'})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class RunDirLock:
    """An exclusive, stale-tolerant lock on a run dir (see the module docstring)."""

    def __init__(self, run_dir: Path, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.path = run_dir / LOCK_FILE
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.host = host_name()
        self._file = FlockFile(self.path, _RECORD_BYTES)
        self._holder: Holder | None = None
        self._heartbeat: Heartbeat | None = None

    def acquire(self) -> None:
        try:
            self._file.open()
        except OSError as err:
            raise write_error(self.path, err, "create the lock file") from None
        try:
            state = self._file.lock()
        except OSError as err:
            raise write_error(self.path, err, "lock") from None
        if state == FlockFile.HELD:
            raise self._refusal(self._read(), "holds its lock")
        if state == FlockFile.UNSUPPORTED:
            log.warning("%s: flock is not supported on this filesystem; relying on the holder record and its "
                        "heartbeat", self.path)
        try:
            self._check_previous(self._read(), state == FlockFile.GRANTED)
            self._holder = Holder.mine(started_unix=time.time(), argv=list(sys.argv))
            self._write()
        except BaseException:
            self._file.close()
            raise
        self._heartbeat = Heartbeat(self._beat, self.heartbeat_s, "dflash-rundir-heartbeat").start()

    def release(self) -> None:
        if self._file.fd is None:
            return
        if self._heartbeat is not None:
            self._heartbeat.stop()
        assert self._holder is not None
        self._holder.released = True
        try:
            self._write()
        except RunDirError as err:  # the lock is freed by closing the file anyway
            log.warning("could not mark %s released: %s", self.path, err)
        self._file.close()  # releases the flock

    # ------------------------------------------------------------------------------------------

    def _check_previous(self, prev: Holder | None, flocked: bool) -> None:
        if prev is None or prev.released or (prev.pid == os.getpid() and prev.host == self.host):
            return
        if prev.in_this_namespace() or (not prev.pidns and prev.host == self.host):  # (no pidns: an older record)
            running = prev.process_alive() if prev.pidns else _pid_alive(prev.pid)
            if not flocked and running:
                raise self._refusal(prev, "is running")
            log.warning("%s: taking over the lock of %s, which is no longer running", self.path, prev.describe())
            return
        # another host: a granted flock may be node-local, so watch the heartbeat. Its clock may differ from
        # ours: only a record far older than the threshold is judged by its timestamp; otherwise it must stay
        # unchanged for stale_after_s of our own time
        if prev.heartbeat_age() < 10 * self.stale_after_s:
            log.info("%s names %s with a heartbeat %.0f s ago: watching it for %.0f s to see whether it is alive",
                     self.path, prev.describe(), prev.heartbeat_age(), self.stale_after_s)
            now = heartbeat_advances(self._read, prev, self.stale_after_s, self.heartbeat_s)
            if now is not None:
                raise self._refusal(now, "is alive (its heartbeat advances)")  # type: ignore[arg-type]
        log.warning("%s: taking over the lock of %s: its heartbeat stopped", self.path, prev.describe())

    def _refusal(self, holder: Holder | None, state: str) -> RunDirError:
        who = holder.describe() if holder else "another process (its record is unreadable)"
        return RunDirError(
            f"run dir {self.path.parent} is in use: {who} {state}. Two trainers on one run dir would overwrite "
            "each other's checkpoints and metrics. Wait for it to finish or stop it (SIGTERM saves a checkpoint; "
            "rerunning then resumes), or use another --run-dir"
        )

    def _read(self) -> Holder | None:
        rec = self._file.read()
        try:
            return Holder.from_dict(rec) if rec is not None else None
        except (ValueError, TypeError):
            return None

    def _write(self) -> None:
        assert self._holder is not None
        try:
            self._file.write(json.dumps(asdict(self._holder)).encode())
        except OSError as err:
            raise write_error(self.path, err) from None

    def _beat(self) -> None:
        assert self._holder is not None
        self._holder.heartbeat_unix = time.time()
        try:
            self._write()
        except RunDirError as err:
            log.warning("run dir heartbeat: %s", err)


class RunDir:
    """The claimed run directory of this job: ``with RunDir.claim(path, d) as run: ...``."""

    def __init__(self, path: Path, lock: RunDirLock | None):
        self.path, self._lock = path, lock

    @classmethod
    def claim(cls, path: str | Path, d: Distributed) -> RunDir:
        """Rank 0 creates, checks and locks the run dir; every rank gets the same outcome (exit 2 on a refusal)."""
        if "://" in str(path):  # (Path() would turn s3://b/run into a local directory named s3:)
            raise RunDirError(f"--run-dir {path} is a URL: run dirs must be a local or shared-filesystem path "
                              "(checkpoints are written, fsynced and renamed into place, which object stores cannot "
                              "do atomically); use a local path and copy finished checkpoints to object storage")
        path = Path(path)
        lock, problem = None, None
        if d.is_main:
            try:
                _make_dir(path)
                lock = RunDirLock(path)
                lock.acquire()
            except RunDirError as err:
                problem = str(err)
        problem = d.broadcast_object(problem)
        if problem:
            raise RunDirError(problem)
        return cls(path, lock)

    def write_config(self, resolved: dict[str, Any], d: Distributed) -> None:
        """The resolved config of the current run (checkpoints keep the config each was written with)."""
        if not d.is_main:
            return
        target = self.path / CONFIG_FILE
        try:
            tmp = target.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(resolved, indent=1))
            os.replace(tmp, target)
        except OSError as err:
            raise write_error(target, err) from None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _make_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--run-dir {path} is a file, not a directory; choose a directory path (it is created "
                          "if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(path, err, "create the run dir") from None

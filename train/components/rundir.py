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
unsupported, a record of this host is checked by PID instead.

Everything a trainer writes into the run dir goes through :func:`write_error` when the operating system
refuses it (read-only, permissions, no space), so the user sees the path and what to do, not a traceback.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from dflash_cache.errors import DFlashError
from dflash_cache.runtime.dist import Distributed

log = logging.getLogger(__name__)

LOCK_FILE = "trainer.lock"
CONFIG_FILE = "config.json"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0  # six missed heartbeats: the holder (or its node) is gone
_RECORD_BYTES = 2048  # the record is rewritten in place, padded to this size (the flock'ed inode must stay)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


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
class Holder:
    """Who holds a run dir (the content of ``RUN/trainer.lock``)."""

    pid: int
    host: str
    started_unix: float
    heartbeat_unix: float
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
        self.host = socket.gethostname()
        self._fd: int | None = None
        self._holder: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise write_error(self.path, err, "create the lock file") from None
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refusal(self._read(), "holds its lock") from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                os.close(fd)
                raise write_error(self.path, err, "lock") from None
            flocked = False
            log.warning("%s: flock is not supported on this filesystem (%s); relying on the holder record "
                        "and its heartbeat", self.path, err.strerror)
        self._fd = fd
        try:
            self._check_previous(self._read(), flocked)
            now = time.time()
            self._holder = Holder(os.getpid(), self.host, now, now, list(sys.argv))
            self._write()
        except BaseException:
            os.close(fd)
            self._fd = None
            raise
        self._thread = threading.Thread(target=self._beat, name="dflash-rundir-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        assert self._holder is not None
        self._holder.released = True
        try:
            self._write()
        except RunDirError as err:  # the lock is freed by closing the file anyway
            log.warning("could not mark %s released: %s", self.path, err)
        os.close(self._fd)  # releases the flock
        self._fd = None

    # ------------------------------------------------------------------------------------------

    def _check_previous(self, prev: Holder | None, flocked: bool) -> None:
        if prev is None or prev.released or (prev.pid == os.getpid() and prev.host == self.host):
            return
        if prev.host == self.host:
            if not flocked and _pid_alive(prev.pid):
                raise self._refusal(prev, "is running")
            log.warning("%s: taking over the lock of %s, which is no longer running", self.path, prev.describe())
            return
        # another host: a granted flock may be node-local, so watch the heartbeat. Its clock may differ from
        # ours: only a record far older than the threshold is judged by its timestamp; otherwise it must stay
        # unchanged for stale_after_s of our own time
        if time.time() - prev.heartbeat_unix < 10 * self.stale_after_s:
            log.info("%s names %s with a heartbeat %.0f s ago: watching it for %.0f s to see whether it is alive",
                     self.path, prev.describe(), time.time() - prev.heartbeat_unix, self.stale_after_s)
            until = time.monotonic() + self.stale_after_s
            while time.monotonic() < until:
                time.sleep(min(self.heartbeat_s, max(0.0, until - time.monotonic())) + 0.01)
                now = self._read()
                if now is None or now.released:
                    return
                if now.heartbeat_unix != prev.heartbeat_unix:
                    raise self._refusal(now, "is alive (its heartbeat advances)")
        log.warning("%s: taking over the lock of %s: its heartbeat stopped", self.path, prev.describe())

    def _refusal(self, holder: Holder | None, state: str) -> RunDirError:
        who = holder.describe() if holder else "another process (its record is unreadable)"
        return RunDirError(
            f"run dir {self.path.parent} is in use: {who} {state}. Two trainers on one run dir would overwrite "
            "each other's checkpoints and metrics. Wait for it to finish or stop it (SIGTERM saves a checkpoint; "
            "rerunning then resumes), or use another --run-dir"
        )

    def _read(self) -> Holder | None:
        for _ in range(3):  # a read racing the heartbeat's rewrite can see a torn record: read again
            try:
                text = self.path.read_bytes().rstrip(b"\0 \n")
            except OSError:
                return None
            if not text:
                return None
            try:
                return Holder(**json.loads(text))
            except (ValueError, TypeError):
                time.sleep(0.05)
        return None

    def _write(self) -> None:
        assert self._fd is not None and self._holder is not None
        data = json.dumps(asdict(self._holder)).encode()[: _RECORD_BYTES - 1] + b"\n"
        try:
            os.pwrite(self._fd, data.ljust(_RECORD_BYTES, b" "), 0)
            os.fsync(self._fd)
        except OSError as err:
            raise write_error(self.path, err) from None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
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

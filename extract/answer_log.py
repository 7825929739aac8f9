"""The output of ``dflash-extract regenerate --endpoint``: an append-only JSONL log, one line per answered
conversation, that a rerun resumes.

What it guarantees, and why:

- One writer per log: an exclusive ``flock`` on ``OUT.lock``, released by the kernel however the process
  ends (SIGKILL included), so a crashed run never leaves a stale lock. A second process is refused with
  the holder's pid, host and start time (two writers would answer the same prompts twice).
- A line is written by one ``os.write`` of the whole line on an ``O_APPEND`` descriptor, so a killed
  process never leaves half a line: an answer is safe in the page cache the moment the call returns.
- ``fsync`` at most every ``fsync_every_s`` seconds and at close: a machine crash loses at most those
  seconds of answers and can leave one torn (or zero-filled) last line, which the next open cuts off
  (logged). Anything else that does not parse, a duplicate id or a line from another input file is an
  error naming ``file:line``: the log is never silently rewritten.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from dflash_cache.errors import DataError, DFlashError
from dflash_cache.locks import FlockFile, HolderRecord
from dflash_cache.storage import fsync_dir

log = logging.getLogger(__name__)


class OutputLockedError(DFlashError):
    """Another process holds the output log."""


class OutputLock:
    """An exclusive ``flock`` on ``OUT.lock`` naming its holder (:class:`dflash_cache.locks.FlockFile`); both
    regenerate paths hold it while they write OUT (the file stays after a run: only the lock matters)."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = self.out.with_name(self.out.name + ".lock")
        self._file = FlockFile(self.path, 1024)

    def acquire(self) -> OutputLock:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        state = self._file.open().lock()
        if state == FlockFile.HELD:
            h = self._file.read()
            try:
                holder = f"pid {h['pid']} on {h['host']}, since {h['started']}"  # type: ignore[index]
            except (KeyError, TypeError):
                holder = json.dumps(h) if h else "unknown"
            raise OutputLockedError(
                f"{self.out} is being written by another dflash-extract regenerate ({holder}); two writers "
                "would ask the same prompts twice. Wait for it to finish, stop it, or choose another --out"
            )
        if state == FlockFile.UNSUPPORTED:
            log.warning("%s: flock is not supported on this filesystem: a second writer would not be refused",
                        self.path)
        self._file.write(HolderRecord.mine().to_json(started=time.strftime("%Y-%m-%d %H:%M:%S")), sync=False)
        return self

    def release(self) -> None:
        self._file.close()  # closing the descriptor drops the flock

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class AnswerLog:
    """``open()`` takes the lock and returns the ids already answered; ``append`` adds one record."""

    def __init__(self, path: str | Path, prompts_fingerprint: str, fsync_every_s: float):
        self.path = Path(path)
        self.lock = OutputLock(self.path)
        self.fingerprint = prompts_fingerprint
        self.fsync_every_s = fsync_every_s
        self._fd: int | None = None
        self._mutex = threading.Lock()
        self._last_sync = 0.0
        self.n_written = 0

    # -- open / resume ----------------------------------------------------------------------------------

    def open(self) -> set[int]:
        if "://" in str(self.path):
            raise DataError(f"--out {self.path}: the endpoint output is a local (or NFS) file, not a URL; "
                            "copy it to object storage afterwards")
        self.lock.acquire()
        try:
            done = self._scan()
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if created:  # the new directory entry must survive a crash too
                fsync_dir(self.path.parent)
        except BaseException:
            self.lock.release()
            raise
        self._last_sync = time.monotonic()
        return done

    def _scan(self) -> set[int]:
        """Ids already answered; a torn last line (interrupted write) is cut off."""
        done: set[int] = set()
        if not self.path.exists():
            return done
        good_end = 0  # byte offset after the last good line
        damaged: tuple[int, str] | None = None  # (line number, why) of a line that is not a complete record
        with self.path.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                where = f"{self.path}:{lineno}"
                if damaged is not None:
                    raise DataError(f"{self.path}:{damaged[0]}: {damaged[1]}, and more lines follow it: this is "
                                    "not a torn last write; repair or remove the line, or choose another --out")
                try:
                    rec = json.loads(line) if line.endswith(b"\n") else None
                except (ValueError, UnicodeDecodeError):
                    rec = None
                if rec is None:
                    damaged = (lineno, "not a complete JSON line")
                    continue
                sid = rec.get("id") if isinstance(rec, dict) else None
                if not isinstance(sid, int) or "messages" not in rec:
                    raise DataError(f"{where}: not a regenerate output line (expected id, messages, "
                                    "prompts_fingerprint); choose another --out")
                if rec.get("prompts_fingerprint") != self.fingerprint:
                    raise DataError(
                        f"{where}: answers a different input (prompts fingerprint {rec.get('prompts_fingerprint')}, "
                        f"this input is {self.fingerprint}); resume with the same --data, or choose another --out")
                if sid in done:
                    raise DataError(f"{where}: id {sid} is answered twice; the log was edited or written by two "
                                    "processes; remove the duplicate line")
                done.add(sid)
                good_end = f.tell()
        if damaged is not None:
            size = self.path.stat().st_size
            log.warning("%s:%d: cutting off a torn last line (%d bytes) left by an interrupted write",
                        self.path, damaged[0], size - good_end)
            with self.path.open("r+b") as f:
                f.truncate(good_end)
                os.fsync(f.fileno())
        return done

    # -- writing ----------------------------------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> bool:
        """Write one record (one line, one ``write``); False when the log is already closed."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._mutex:
            if self._fd is None:
                return False
            view = memoryview(data)
            while view:  # a short write only happens on a full disk; the error then stops the run
                view = view[os.write(self._fd, view):]
            self.n_written += 1
            now = time.monotonic()
            if now - self._last_sync >= self.fsync_every_s:
                os.fsync(self._fd)
                self._last_sync = now
        return True

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                finally:
                    os.close(self._fd)
                    self._fd = None
        self.lock.release()

    def __enter__(self) -> AnswerLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Locks: one holder at a time, across processes and hosts, and how a dead holder is told from a live one.

Every lock of the pipeline (a cache part's lease, the run dir's ``trainer.lock``, the answer log's
``OUT.lock``) is built from the primitives here:

- **Exclusive creation.** Either a generation file ``<dir>/<prefix>.<gen>.json`` created with
  :meth:`Storage.create_exclusive` (a hard link on local and NFS paths, a conditional put on object
  stores: of several contenders exactly one creates a generation), see :class:`GenerationLock`; or,
  for a local path, an exclusive ``flock`` on a record file (:class:`FlockFile`), which the kernel
  releases however its holder ends.
- **A holder record** (:class:`HolderRecord`): host identity (the hostname, or ``DFLASH_HOST_ID``),
  pid, pid namespace, process start time, heartbeat time, generation and a random token.
- **The staleness rule** (:meth:`HolderRecord.alive`): a holder in this pid namespace (same host,
  same boot, same ``/proc/self/ns/pid``) is alive while its pid runs with the recorded start time (a
  reused pid does not count); a holder elsewhere is alive while its heartbeat is younger than the
  timeout (the hosts' clocks must agree to well within it). :func:`heartbeat_advances` judges a
  holder elsewhere by its own clock instead, for callers that can afford to watch.
- **Heartbeat refresh** (:class:`Keeper`: one daemon thread per registry rewrites every held lock's
  record), **takeover** (a stale newest generation is superseded by creating the next one) and
  **release** (the holder removes its generation files; nothing else does while it is alive).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from .runtime.switches import env_switch
from .storage import Storage

NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # filesystems without flock


# -- identity ------------------------------------------------------------------------------------------


def host_name() -> str:
    """This host's name in holder records; ``DFLASH_HOST_ID`` overrides it (and makes this process count as
    another host: liveness by heartbeat only), e.g. to run two "nodes" on one machine."""
    return env_switch("DFLASH_HOST_ID") or socket.gethostname()


def _read_proc(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


_PIDNS: dict[str | None, str] = {}


def pid_namespace() -> str:
    """``host/boot id/pid-namespace inode``: equal iff a pid recorded by the other process means the same
    process here. With ``DFLASH_HOST_ID`` set it is that identity (another "host": judged by heartbeat)."""
    host_id = env_switch("DFLASH_HOST_ID")
    if host_id not in _PIDNS:
        if host_id:
            _PIDNS[host_id] = f"host-id:{host_id}"
        else:
            try:
                ns = str(os.stat("/proc/self/ns/pid").st_ino)
            except OSError:
                ns = "?"
            boot = _read_proc("/proc/sys/kernel/random/boot_id") or "?"
            _PIDNS[host_id] = f"{socket.gethostname()}/{boot}/{ns}"
    return _PIDNS[host_id]


def process_start(pid: int) -> str | None:
    """Start time (clock ticks since boot) of running ``pid``; "" when it is not running; None when it
    runs but this system cannot tell its start time (no /proc)."""
    if os.path.isdir("/proc/self"):
        stat = _read_proc(f"/proc/{pid}/stat")
        if stat is None:
            return ""
        return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime); fields after "(comm)" start at 3
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return None


_START: dict[int, str | None] = {}


def own_start() -> str | None:
    """This process's start time, looked up per pid: a child forked after this module was imported has
    its own (with the parent's, its locks would look dead to everyone and be taken over)."""
    pid = os.getpid()
    if pid not in _START:
        _START[pid] = process_start(pid)
    return _START[pid]


# -- the holder record and the staleness rule ------------------------------------------------------------


@dataclass
class HolderRecord:
    """Who holds (or held) a lock. Subclasses add their own fields (all with defaults)."""

    host: str = ""
    pid: int = 0
    pidns: str = ""  # "" in records written before it was recorded: never this namespace
    start: str | None = None
    heartbeat_unix: float = 0.0
    gen: int = 0
    token: str = ""

    @classmethod
    def mine(cls, **extra: Any) -> Any:
        """A record naming this process now."""
        return cls(host=host_name(), pid=os.getpid(), pidns=pid_namespace(), start=own_start(),
                   heartbeat_unix=time.time(), **extra)

    @classmethod
    def from_dict(cls, rec: dict[str, Any]) -> Any:
        """The record of a parsed JSON object; unknown keys are ignored, wrong types raise TypeError/ValueError."""
        known = {f.name for f in fields(cls)}
        out = cls(**{k: v for k, v in rec.items() if k in known})
        out.pid, out.heartbeat_unix = int(out.pid), float(out.heartbeat_unix)
        return out

    def to_json(self, **extra: Any) -> bytes:
        return json.dumps({**asdict(self), **extra}).encode()

    def in_this_namespace(self) -> bool:
        """Its pid means the same process here (same host, boot and pid namespace)."""
        return bool(self.pidns) and self.pidns == pid_namespace()

    def process_alive(self) -> bool:
        """Its pid runs with the recorded start time (a reused pid does not count; without /proc, running)."""
        start = process_start(self.pid)
        return start is None or (start != "" and start == self.start)

    def heartbeat_age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.heartbeat_unix

    def alive(self, timeout_s: float, holds: Callable[[str], bool] | None = None) -> bool:
        """The staleness rule (see the module docstring). ``holds``: for a record of this very process,
        whether it still holds the lock with that token (default: yes)."""
        if self.in_this_namespace():  # the pid is authoritative here
            if self.pid == os.getpid():
                return holds(self.token) if holds is not None else True
            return self.process_alive()
        return self.heartbeat_age() < timeout_s


def heartbeat_advances(read: Callable[[], HolderRecord | None], first: HolderRecord, window_s: float,
                       poll_s: float) -> HolderRecord | None:
    """Watch a holder elsewhere for ``window_s`` seconds of this host's clock (immune to clock skew):
    the record that shows its heartbeat advancing (alive), or None when it did not within the window,
    vanished, or was marked released (``released`` attribute true)."""
    until = time.monotonic() + window_s
    while time.monotonic() < until:
        time.sleep(min(poll_s, max(0.0, until - time.monotonic())) + 0.01)
        now = read()
        if now is None or getattr(now, "released", False):
            return None
        if now.heartbeat_unix != first.heartbeat_unix:
            return now
    return None


# -- heartbeat refresh ----------------------------------------------------------------------------------


class Heartbeat:
    """A daemon thread that calls ``beat()`` every ``interval_s`` seconds until :meth:`stop`, which waits for
    it (so that nothing is written once the holder has released its lock). Errors (OSError) go to
    ``on_error``: a record that cannot be refreshed just ages."""

    def __init__(self, beat: Callable[[], None], interval_s: float, name: str,
                 on_error: Callable[[OSError], None] | None = None):
        self._beat, self.interval_s, self._on_error = beat, interval_s, on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except OSError as err:
                if self._on_error is not None:
                    self._on_error(err)


class Beating(Protocol):
    token: str

    def beat(self) -> None: ...


class Keeper:
    """Tokens of the locks this process holds, and the daemon thread that refreshes their heartbeats every
    ``interval()`` seconds. A token is *reserved* while its lock file is being created, so that another
    thread of this process reading the file never takes the lock for abandoned."""

    def __init__(self, interval: Callable[[], float], name: str = "dflash-lock-heartbeat",
                 on_error: Callable[[Any, OSError], None] | None = None):
        self._interval, self._name, self._on_error = interval, name, on_error
        self._lock = threading.Lock()
        self._held: dict[str, Beating] = {}
        self._reserved: set[str] = set()
        self._thread: threading.Thread | None = None

    def holds(self, token: str) -> bool:
        with self._lock:
            return token in self._held or token in self._reserved

    def reserve(self, token: str) -> None:
        with self._lock:
            self._reserved.add(token)

    def unreserve(self, token: str) -> None:
        with self._lock:
            self._reserved.discard(token)

    def add(self, lock: Beating) -> None:
        with self._lock:
            self._reserved.discard(lock.token)
            self._held[lock.token] = lock
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def drop(self, lock: Beating) -> None:
        with self._lock:
            self._held.pop(lock.token, None)

    def _run(self) -> None:
        while True:
            time.sleep(self._interval())
            with self._lock:
                held = list(self._held.values())
            for lock in held:
                try:
                    lock.beat()
                except OSError as err:  # e.g. a full disk: the record ages; the holder finds out later
                    if self._on_error is not None:
                        self._on_error(lock, err)


# -- exclusive generations on a Storage -----------------------------------------------------------------


def generation_file(prefix: str, gen: int) -> str:
    return f"{prefix}.{gen:06d}.json"


def generation_of(prefix: str, name: str) -> int | None:
    """The generation of a lock file name (``lease.000003.json`` -> 3 for prefix ``lease``), else None."""
    m = re.match(rf"^{re.escape(prefix)}\.(\d+)\.json$", name)
    return int(m.group(1)) if m else None


def newest_generation(storage: Storage, directory: str, prefix: str,
                      parse: Callable[[int, bytes], HolderRecord | None]) -> tuple[int, HolderRecord | None]:
    """``(generation, holder)`` of the newest lock file under ``directory``; ``(0, None)`` when there is
    none; the holder is None when its record cannot be parsed (half-written or foreign: stale)."""
    gen = 0
    for _ in range(5):
        gens = [g for n in storage.list_dir(directory) if (g := generation_of(prefix, n)) is not None]
        if not gens:
            return 0, None
        gen = max(gens)
        try:
            return gen, parse(gen, storage.get(f"{directory}/{generation_file(prefix, gen)}"))
        except FileNotFoundError:  # released (or removed) while we looked: look again
            continue
    return gen, None


class GenerationLock:
    """Generation ``gen`` of the lock ``<directory>/<prefix>.*.json``, held by this process (see
    :func:`take_generation`). Subclasses choose the record (:meth:`holder`) and the keeper."""

    prefix = "lock"

    def __init__(self, storage: Storage, directory: str, gen: int, keeper: Keeper):
        self.storage, self.directory, self.gen, self.keeper = storage, directory, gen, keeper
        self.token = secrets.token_hex(8)
        self.acquired_unix = time.time()
        self.last_beat_unix = self.acquired_unix  # when this process last wrote its record (created or refreshed)
        self._mutex = threading.Lock()
        self._released = False

    @property
    def file(self) -> str:
        return f"{self.directory}/{generation_file(self.prefix, self.gen)}"

    def holder(self) -> HolderRecord:
        return HolderRecord.mine(gen=self.gen, token=self.token)

    def record(self) -> bytes:
        return self.holder().to_json(acquired_unix=self.acquired_unix)

    @classmethod
    def parse(cls, gen: int, raw: bytes) -> HolderRecord | None:
        """The holder record of generation ``gen`` (None: half-written or foreign, i.e. stale)."""
        try:
            return HolderRecord.from_dict({**json.loads(raw), "gen": gen})
        except (ValueError, TypeError, AttributeError):
            return None

    def held(self) -> bool:
        """This generation is still the newest and ours (no other process took the lock over)."""
        gen, holder = newest_generation(self.storage, self.directory, self.prefix, self.parse)
        return gen == self.gen and holder is not None and holder.token == self.token

    def stands(self, superseded: HolderRecord | None) -> bool:
        """Whether the generation this process just created is the lock (checked right after its creation):
        no higher generation exists, and the newest lock file it superseded (``superseded``, None: there was
        none, or it could not be read) is still there. When that one is gone, its holder released it meanwhile
        and may have left the directory without a lock file, so that another process took generation 1 again
        while this one created a higher number: numbering restarted, and the higher number no longer means
        the newer holder. This one then withdraws (:meth:`withdraw`) and looks again."""
        names = self.storage.list_dir(self.directory)
        gens = {g: n for n in names if (g := generation_of(self.prefix, n)) is not None}
        if any(g > self.gen for g in gens):
            return False
        if superseded is None:
            return True
        if superseded.gen not in gens:
            return False
        try:
            return json.loads(self.storage.get(f"{self.directory}/{gens[superseded.gen]}")).get("token") == \
                superseded.token
        except (FileNotFoundError, ValueError, AttributeError):
            return False

    def withdraw(self) -> None:
        """Give back a generation just created that does not stand: remove this generation's own file only
        (never another holder's), and hold nothing."""
        with self._mutex:
            self._released = True
        self.keeper.drop(self)
        self.keeper.unreserve(self.token)
        try:
            mine = json.loads(self.storage.get(self.file)).get("token") == self.token
        except (FileNotFoundError, ValueError, AttributeError):
            mine = False
        if mine:
            self.storage.remove(self.file)

    def beat(self) -> None:
        """Refresh the heartbeat; never brings back a file that another process removed (a takeover)."""
        with self._mutex:
            if self._released:
                return
            try:
                mine = json.loads(self.storage.get(self.file)).get("token") == self.token
            except (FileNotFoundError, ValueError, AttributeError):
                mine = False
            if mine:
                self.storage.put(self.file, self.record())
                self.last_beat_unix = time.time()

    def release(self, remove_dir: bool = False) -> None:
        """Give the lock up: remove this generation's file and older ones; with ``remove_dir`` also the
        directory when nothing else is left in it. A lock that was taken over (another generation is the
        newest, or its file is gone) removes nothing: its number may name another holder's file by now
        (after the directory was removed, numbering starts again), and the newer holder removes the
        older files when it releases."""
        with self._mutex:
            if self._released:
                return
            self._released = True
        self.keeper.drop(self)
        if not self.held():
            return
        for name in self.storage.list_dir(self.directory):
            g = generation_of(self.prefix, name)
            if g is not None and g <= self.gen:
                self.storage.remove(f"{self.directory}/{name}")
        if remove_dir:
            self.storage.remove_empty_dir(self.directory)


class Contended(Exception):
    """:func:`take_generation` found a live holder (``holder``), or kept losing races (``holder`` None)."""

    def __init__(self, holder: HolderRecord | None):
        super().__init__("held" if holder is not None else "contended")
        self.holder = holder


def take_generation(make: Callable[[int], GenerationLock], newest: Callable[[], tuple[int, HolderRecord | None]],
                    live: Callable[[HolderRecord | None], bool], check: Callable[[], None] = lambda: None,
                    tries: int = 32) -> tuple[GenerationLock, HolderRecord | None]:
    """Acquire a generation lock: while the ``newest()`` holder is not ``live``, create the next generation
    exclusively (a takeover when there was a holder). ``make(gen)`` builds the lock object (its file not
    yet created); ``check()`` runs before every attempt and after a success (it raises to refuse, e.g. the
    locked object is finished; the lock is then given back). Returns ``(lock, previous holder or None)``;
    raises :class:`Contended` when a live holder has it (naming it), or when each of ``tries`` attempts lost
    to a holder that had already given the lock back (holder None). A lost race -- another process created
    the generation first, or released the lock and removed its empty directory while this one created its
    file there, or a created generation does not stand (:meth:`GenerationLock.stands`: the lock's files
    were all released meanwhile and another process started the numbering again) -- is retried after a
    random back-off; it never ends the attempt with an error of its own."""
    holder = None
    for attempt in range(tries):
        if attempt:  # lost a race: back off a random while, so that contenders stop meeting in lockstep
            time.sleep(random.uniform(0.0, min(0.05, 0.001 * 2 ** attempt)))
        check()
        gen, holder = newest()
        if live(holder):
            raise Contended(holder)
        lock = make(gen + 1)
        lock.keeper.reserve(lock.token)  # held from the moment its file exists
        try:
            created = lock.storage.create_exclusive(lock.file, lock.record())
        except FileNotFoundError:
            # the directory was removed while we created the file in it: its holder released it (an empty
            # lock directory is removed) after we looked; a lost race like any other, so look again
            created = False
        if not created:
            lock.keeper.unreserve(lock.token)
            # another process created this generation first: it holds the lock unless it gave it back already
            _, contender = newest()
            if live(contender):
                raise Contended(contender)
            continue
        if not lock.stands(holder):  # numbering restarted under this attempt: a lost race too
            lock.withdraw()
            _, contender = newest()
            if live(contender):
                raise Contended(contender)
            continue
        lock.keeper.add(lock)
        try:
            check()
        except BaseException:
            lock.release()
            raise
        return lock, holder
    _, holder = newest()  # every try lost to a holder that gave the lock back at once: name one that holds it now
    raise Contended(holder if live(holder) else None)


# -- an exclusive flock on a local record file -----------------------------------------------------------


class FlockFile:
    """An exclusive ``flock`` on a local file that also holds its holder's record, rewritten in place
    (padded to ``size`` bytes: the locked inode must stay). The kernel drops the lock when the holder
    dies, so a crashed holder never leaves it taken; the record names the holder to whoever is refused."""

    GRANTED, HELD, UNSUPPORTED = "granted", "held", "unsupported"

    def __init__(self, path: str | Path, size: int = 2048):
        self.path, self.size = Path(path), size
        self.fd: int | None = None

    def open(self) -> FlockFile:
        """Open (creating) the record file; raises OSError when it cannot be created or opened."""
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        return self

    def lock(self) -> str:
        """Try the lock on the open file: GRANTED, HELD (by another open file description; the file is
        closed again) or UNSUPPORTED (this filesystem has no flock: the file stays open, unlocked).
        Raises OSError when the lock fails for another reason (the file is closed)."""
        assert self.fd is not None, "open() first"
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            return self.HELD
        except OSError as err:
            if err.errno not in NO_FLOCK:
                self.close()
                raise
            return self.UNSUPPORTED
        return self.GRANTED

    def read(self, retries: int = 3) -> dict[str, Any] | None:
        """The record (None when empty, missing or unreadable; a read racing a rewrite is retried)."""
        for _ in range(retries):
            try:
                text = self.path.read_bytes().rstrip(b"\0 \n")
            except OSError:
                return None
            if not text:
                return None
            try:
                rec = json.loads(text)
                return rec if isinstance(rec, dict) else None
            except ValueError:
                time.sleep(0.05)
        return None

    def write(self, data: bytes, sync: bool = True) -> None:
        """Rewrite the record in place (one ``pwrite`` of the padded record; ``fsync`` unless ``sync`` is False)."""
        assert self.fd is not None
        data = data[: self.size - 1] + b"\n"
        os.pwrite(self.fd, data.ljust(self.size, b" "), 0)
        if sync:
            os.fsync(self.fd)

    def close(self) -> None:
        """Close the file (which drops the flock)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

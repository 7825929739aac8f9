"""Part leases: at most one live writer per part, across processes and hosts.

A process holds part ``P`` while the newest lease file ``P/lease.<gen>.json`` is its own. To take a
part it reads the newest lease; when there is none, or its holder is gone, it creates generation
``gen + 1`` with :meth:`Storage.create_exclusive` (a hard link on local filesystems, a conditional
put on object stores). Of several contenders exactly one creates a generation, so two processes
never hold one part, and nothing is removed under a part except by its holder (and never once the
part has a commit record: the commit record is created exclusively too).

A holder is live when

- it runs in this process's pid namespace (same host, same boot, same ``/proc/self/ns/pid``): its
  pid is running with the start time recorded in the lease. A reused pid does not count, so a job
  restarted in the same container takes over at once;
- otherwise (another host or container): its heartbeat is younger than ``timeout_s``. A daemon
  thread rewrites the heartbeat of every lease this process holds every :data:`HEARTBEAT_S`.

Limits, by design: across hosts liveness rests on the heartbeat, so a writer that stalls for longer
than ``timeout_s`` (default :data:`LEASE_TIMEOUT_S`) can lose its part to another process; it
writes only into its own generation's directory, which nothing reads, and its commit is refused
(:mod:`dflash_cache.fence`). The hosts' clocks must
agree to well within ``timeout_s`` (NTP). Exclusive creation is atomic on local and NFS paths (hard
links) and ``memory://``; on another fsspec filesystem only where its ``pipe_file(mode="create")`` is
a conditional write (``If-None-Match`` on S3-compatible stores, in implementations that support it).
Where it is fsspec's generic check-then-write, two processes that race for one free part within the
same moment could both create it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import CacheError
from .parts import COMMIT, gen_of
from .runtime.switches import env_switch
from .storage import Storage

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0  # how often a holder refreshes its leases
LEASE_TIMEOUT_HEARTBEATS = 20  # extract.lease_timeout_s unset: this many missed heartbeats
LEASE_TIMEOUT_S = LEASE_TIMEOUT_HEARTBEATS * HEARTBEAT_S  # a lease from another host without a heartbeat for
# this long is stale (600 s)
RELEASED_HOSTS = "meta/released_hosts"  # <host>.json: that host's leases up to then are declared dead
_LEASE = re.compile(r"^lease\.(\d+)\.json$")


def lease_name(gen: int) -> str:
    return f"lease.{gen:06d}.json"


def is_lease_file(name: str) -> bool:
    return _LEASE.match(name) is not None


def _read_proc(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _host_name() -> str:
    """This host's name in lease records; ``DFLASH_HOST_ID`` overrides it (and makes this process count as
    another host: liveness by heartbeat only), e.g. to run two "nodes" on one machine."""
    return env_switch("DFLASH_HOST_ID") or socket.gethostname()


def _pid_namespace() -> str:
    """``host/boot id/pid-namespace inode``: equal iff a pid recorded by the other process means the same
    process here."""
    host_id = env_switch("DFLASH_HOST_ID")  # another "host" (two nodes on one machine): liveness by heartbeat
    if host_id:
        return f"host-id:{host_id}"
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "?"
    return f"{socket.gethostname()}/{_read_proc('/proc/sys/kernel/random/boot_id') or '?'}/{ns}"


def _process_start(pid: int) -> str | None:
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


_PIDNS = _pid_namespace()
_START: dict[int, str | None] = {}


def _own_start() -> str | None:
    """This process's start time, looked up per pid: a child forked after this module was imported has
    its own (with the parent's, its leases would look dead to everyone and be taken over)."""
    pid = os.getpid()
    if pid not in _START:
        _START[pid] = _process_start(pid)
    return _START[pid]


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a part: the parsed lease record."""

    gen: int
    token: str
    host: str
    pid: int
    pidns: str
    start: str | None
    heartbeat_unix: float

    @classmethod
    def parse(cls, gen: int, raw: bytes) -> Holder | None:
        try:
            rec = json.loads(raw)
            return cls(gen, str(rec["token"]), str(rec["host"]), int(rec["pid"]), str(rec["pidns"]),
                       rec.get("start"), float(rec["heartbeat_unix"]))
        except (ValueError, KeyError, TypeError):
            return None  # half-written (filesystems without hard links) or foreign: treated as stale

    def alive(self, timeout_s: float) -> bool:
        if self.pidns == _PIDNS:  # the pid is authoritative here
            if self.pid == os.getpid():
                return _keeper.holds(self.token)
            start = _process_start(self.pid)
            return start is None or (start != "" and start == self.start)
        return time.time() - self.heartbeat_unix < timeout_s

    @property
    def who(self) -> str:
        return f"pid {self.pid} on host {self.host}"

    def describe(self) -> str:
        return f"{self.who} (heartbeat {max(0.0, time.time() - self.heartbeat_unix):.0f} s ago)"


class PartCommittedError(CacheError):
    """The part already has a commit record: there is nothing to write."""


class LeaseHeldError(CacheError):
    """A live writer holds the part."""

    def __init__(self, key: str, holder: Holder):
        super().__init__(f"part {key} is being written by {holder.describe()}; wait for it to finish, or stop "
                         "that process first")
        self.key, self.holder = key, holder


class LeaseLostError(CacheError):
    """This process's lease was taken over (its heartbeat looked stale to another process)."""


def newest(storage: Storage, key: str) -> tuple[int, Holder | None]:
    """``(generation, holder)`` of the newest lease of part ``key``; ``(0, None)`` when there is none."""
    for _ in range(5):
        gens = [int(m.group(1)) for n in storage.list_dir(key) if (m := _LEASE.match(n))]
        if not gens:
            return 0, None
        gen = max(gens)
        try:
            return gen, Holder.parse(gen, storage.get(f"{key}/{lease_name(gen)}"))
        except FileNotFoundError:  # released (or the part committed) while we looked: look again
            continue
    return gen, None


def live_holder(storage: Storage, key: str, timeout_s: float = LEASE_TIMEOUT_S) -> Holder | None:
    """The live writer of part ``key``, if any."""
    _, holder = newest(storage, key)
    return holder if _live(storage, holder, timeout_s) else None


def _live(storage: Storage, holder: Holder | None, timeout_s: float) -> bool:
    """``holder`` is alive and its host was not released (:func:`release_host`) after its last heartbeat."""
    if holder is None or not holder.alive(timeout_s):
        return False
    if holder.pidns == _PIDNS:
        return True  # the pid is authoritative here
    released = released_at(storage, holder.host)
    return released is None or holder.heartbeat_unix > released


def _host_file(host: str) -> str:
    return f"{RELEASED_HOSTS}/{re.sub(r'[^A-Za-z0-9._-]', '_', host)}.json"


def released_at(storage: Storage, host: str) -> float | None:
    """When ``host``'s leases were last declared dead (unix time), if ever."""
    try:
        return float(json.loads(storage.get(_host_file(host)))["released_unix"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def host_leases(storage: Storage, keys: list[str]) -> list[tuple[str, Holder]]:
    """``(part key, holder)`` of the newest lease of each of ``keys`` that has one."""
    out = []
    for key in keys:
        _, holder = newest(storage, key)
        if holder is not None:
            out.append((key, holder))
    return out


def release_host(storage: Storage, host: str, keys: list[str], force: bool = False,
                 fresh_s: float = 2 * HEARTBEAT_S) -> list[str]:
    """Declare every lease of ``host`` on ``keys`` (uncommitted parts) dead now: writers elsewhere take
    those parts over at once instead of after the lease timeout. Refused (CacheError) while a heartbeat
    from ``host`` is younger than ``fresh_s`` (the host may be alive), unless ``force``. A writer on that
    host that is in fact alive notices before it commits (its lease is no longer the newest). Returns the
    keys of the parts released."""
    mine = [(k, h) for k, h in host_leases(storage, keys) if h.host == host]
    if mine and not force:
        age = min(time.time() - h.heartbeat_unix for _, h in mine)
        if age < fresh_s:
            raise CacheError(f"host {host} wrote a lease heartbeat {max(age, 0):.0f} s ago (on {len(mine)} part(s)): it "
                             f"may still be running; wait until it is older than {fresh_s:.0f} s (a heartbeat is "
                             f"written every {HEARTBEAT_S:.0f} s), or pass --force if you know the host is gone")
    storage.put(_host_file(host), json.dumps({"host": host, "released_unix": time.time(),
                                              "by": f"{_host_name()} pid {os.getpid()}"}).encode(), durable=True)
    return [k for k, _ in mine]


class PartLease:
    """This process's lease on one part. Get one with :func:`acquire`."""

    def __init__(self, storage: Storage, key: str, gen: int):
        self.storage, self.key, self.gen = storage, key, gen
        self.token = secrets.token_hex(8)
        self.acquired_unix = time.time()
        self._lock = threading.Lock()
        self._released = False

    @property
    def file(self) -> str:
        return f"{self.key}/{lease_name(self.gen)}"

    def record(self) -> bytes:
        return json.dumps({"token": self.token, "host": _host_name(), "pid": os.getpid(),
                           "pidns": _PIDNS, "start": _own_start(), "acquired_unix": self.acquired_unix,
                           "heartbeat_unix": time.time()}).encode()

    def held(self) -> bool:
        """This lease is still the part's newest (no other process took the part over)."""
        gen, holder = newest(self.storage, self.key)
        return gen == self.gen and holder is not None and holder.token == self.token

    def beat(self) -> None:
        with self._lock:
            if self._released:
                return
            try:  # never brings back a lease that another process removed (it took the part over)
                mine = json.loads(self.storage.get(self.file)).get("token") == self.token
            except (FileNotFoundError, ValueError, AttributeError):
                mine = False
            if mine:
                self.storage.put(self.file, self.record())

    def clear_leftovers(self) -> None:
        """Remove what earlier (dead) writers left in the part: their generations' directories (fenced:
        see :mod:`dflash_cache.fence`) and files of the older single-directory layout. Never runs on a
        committed part; never touches this or a newer generation, lease files or seals."""
        from .fence import discard_generation, seal_gen

        if self.storage.exists(f"{self.key}/{COMMIT}"):
            raise PartCommittedError(f"part {self.key} is already committed; a part is written once")
        for name in self.storage.list_dir(self.key):
            g = gen_of(name)
            if g is not None:
                if g < self.gen:
                    discard_generation(self.storage, self.key, g)
            elif not (is_lease_file(name) or seal_gen(name) is not None or name in ("zarr.json", COMMIT)):
                self.storage.remove_entry(f"{self.key}/{name}")

    def release(self, remove_dir: bool = False) -> None:
        """Give the part up: remove this lease file (and older, stale generations); with ``remove_dir``
        also the part's directory when nothing else is left in it."""
        with self._lock:
            if self._released:
                return
            self._released = True
        _keeper.drop(self)
        for name in self.storage.list_dir(self.key):
            m = _LEASE.match(name)
            if m and int(m.group(1)) <= self.gen:
                self.storage.remove(f"{self.key}/{name}")
        if remove_dir:
            self.storage.remove_empty_dir(self.key)


def acquire(storage: Storage, key: str, timeout_s: float = LEASE_TIMEOUT_S) -> PartLease:
    """Take part ``key`` for writing. Raises :class:`PartCommittedError` when it is committed and
    :class:`LeaseHeldError` when a live process holds it."""
    holder = contender = None
    for _ in range(8):
        if storage.exists(f"{key}/{COMMIT}"):
            raise PartCommittedError(f"part {key} is already committed; a part is written once")
        gen, holder = newest(storage, key)
        if _live(storage, holder, timeout_s):
            raise LeaseHeldError(key, holder)  # type: ignore[arg-type]
        lease = PartLease(storage, key, gen + 1)
        # known to this process as held from the moment its file exists (another thread of this process
        # reading the file must not take the part as abandoned)
        _keeper.reserve(lease.token)
        if not storage.create_exclusive(lease.file, lease.record()):
            _keeper.unreserve(lease.token)
            # another writer created this generation first: it holds the part unless it already gave it back
            _, contender = newest(storage, key)
            if _live(storage, contender, timeout_s):
                raise LeaseHeldError(key, contender)  # type: ignore[arg-type]
            continue
        _keeper.add(lease)
        if storage.exists(f"{key}/{COMMIT}"):  # committed by the previous holder just before we looked
            lease.release()
            raise PartCommittedError(f"part {key} is already committed; a part is written once")
        if holder is not None:
            log.info("took over part %s from %s (gone)", key, holder.describe())
        return lease
    if contender is not None or holder is not None:  # other writers kept taking (and giving back) the part
        raise LeaseHeldError(key, contender if contender is not None else holder)
    raise CacheError(f"part {key}: other processes kept taking its lease while this one tried; rerun the command")


class _Keeper:
    """The heartbeat thread of this process: rewrites every held lease every HEARTBEAT_S."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, PartLease] = {}
        self._reserved: set[str] = set()  # leases being created by this process
        self._thread: threading.Thread | None = None

    def holds(self, token: str) -> bool:
        with self._lock:
            return token in self._leases or token in self._reserved

    def reserve(self, token: str) -> None:
        with self._lock:
            self._reserved.add(token)

    def unreserve(self, token: str) -> None:
        with self._lock:
            self._reserved.discard(token)

    def add(self, lease: PartLease) -> None:
        with self._lock:
            self._reserved.discard(lease.token)
            self._leases[lease.token] = lease
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dflash-lease-heartbeat", daemon=True)
                self._thread.start()

    def drop(self, lease: PartLease) -> None:
        with self._lock:
            self._leases.pop(lease.token, None)

    def _run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                try:
                    lease.beat()
                except OSError as err:  # e.g. a full disk: the lease ages; the holder finds out at commit
                    log.warning("could not refresh the lease of part %s: %s", lease.key, err)


_keeper = _Keeper()


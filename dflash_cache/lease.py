"""Part leases: at most one live writer per part, across processes and hosts.

A lease is a :class:`~dflash_cache.locks.GenerationLock` under the part's directory: the shared lock
primitives (exclusive creation, the holder record, the staleness rule, the heartbeat) live in
:mod:`dflash_cache.locks`; this module adds what is particular to parts (commit records, leftovers,
released hosts).

A process holds part ``P`` while the newest lease file ``P/lease.<gen>.json`` is its own. To take a
part it reads the newest lease; when there is none, or its holder is gone, it creates generation
``gen + 1`` with :meth:`Storage.create_exclusive` (a hard link on local filesystems, a conditional
put on object stores). Of several contenders exactly one creates a generation, so two processes
never hold one part, and nothing is removed under a part except by its holder (and never once the
part has a commit record: the commit record is created exclusively too). ``gen`` is one above every
number left in the part (lease files, generation directories, seals). Once ``gc`` removed a part's
directory numbering starts again, so a generation's identity is its number *and* its writer's lease
token (:class:`~dflash_cache.parts.Generation`); a lease that was taken over removes no lease file.

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
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import locks
from .errors import CacheError
from .fence import discard_generation, seal_gen
from .locks import Contended, GenerationLock, HolderRecord, Keeper, generation_of, host_name
from .parts import COMMIT, Generation, gen_of
from .storage import Storage

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0  # how often a holder refreshes its leases
LEASE_TIMEOUT_HEARTBEATS = 20  # extract.lease_timeout_s unset: this many missed heartbeats
LEASE_TIMEOUT_S = LEASE_TIMEOUT_HEARTBEATS * HEARTBEAT_S  # a lease from another host without a heartbeat for
# this long is stale (600 s)
LEASE_TIMEOUT_MIN_S = 3 * HEARTBEAT_S  # the shortest timeout the commands accept (extract.lease_timeout_s,
# gc --min-age): one late heartbeat must not hand a live writer's part to another process
RELEASED_HOSTS = "meta/released_hosts"  # <host>.json: that host's leases up to then are declared dead
_PREFIX = "lease"


def lease_name(gen: int) -> str:
    return locks.generation_file(_PREFIX, gen)


def is_lease_file(name: str) -> bool:
    return generation_of(_PREFIX, name) is not None


@dataclass
class Holder(HolderRecord):
    """Who holds (or held) a part: the parsed lease record (:class:`~dflash_cache.locks.HolderRecord`)."""

    @classmethod
    def parse(cls, gen: int, raw: bytes) -> Holder | None:
        try:
            rec = json.loads(raw)
            if not all(k in rec for k in ("token", "host", "pid", "pidns", "heartbeat_unix")):
                return None
            return cls.from_dict({**rec, "gen": gen, "token": str(rec["token"]), "host": str(rec["host"]),
                                  "pidns": str(rec["pidns"])})
        except (ValueError, TypeError, AttributeError):
            return None  # half-written (filesystems without hard links) or foreign: treated as stale

    def alive(self, timeout_s: float, holds: Callable[[str], bool] | None = None) -> bool:
        """The staleness rule; a lease of this very process is alive while its keeper holds it."""
        return super().alive(timeout_s, _keeper.holds if holds is None else holds)

    @property
    def who(self) -> str:
        return f"pid {self.pid} on host {self.host}"

    def describe(self) -> str:
        return f"{self.who} (heartbeat {max(0.0, self.heartbeat_age()):.0f} s ago)"


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
    return locks.newest_generation(storage, key, _PREFIX, Holder.parse)  # type: ignore[return-value]


def live_holder(storage: Storage, key: str, timeout_s: float = LEASE_TIMEOUT_S) -> Holder | None:
    """The live writer of part ``key``, if any."""
    _, holder = newest(storage, key)
    return holder if _live(storage, holder, timeout_s) else None


def _live(storage: Storage, holder: Holder | None, timeout_s: float) -> bool:
    """``holder`` is alive and its host was not released (:func:`release_host`) after its last heartbeat."""
    if holder is None or not holder.alive(timeout_s):
        return False
    if holder.in_this_namespace():
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
                                              "by": f"{host_name()} pid {os.getpid()}"}).encode(), durable=True)
    return [k for k, _ in mine]


class PartLease(GenerationLock):
    """This process's lease on one part (a :class:`~dflash_cache.locks.GenerationLock` under the part's
    directory). Get one with :func:`acquire`."""

    prefix = _PREFIX

    def __init__(self, storage: Storage, key: str, gen: int, timeout_s: float = LEASE_TIMEOUT_S):
        super().__init__(storage, key, gen, _keeper)
        self.key = key
        self.timeout_s = timeout_s  # the staleness rule this process applied when it took the part

    @property
    def generation(self) -> Generation:
        """The generation this lease writes (its data directory and seal carry this lease's token)."""
        return Generation(self.gen, self.token)

    def holder(self) -> HolderRecord:
        return Holder.mine(gen=self.gen, token=self.token)

    @classmethod
    def parse(cls, gen: int, raw: bytes) -> Holder | None:
        return Holder.parse(gen, raw)

    def clear_leftovers(self) -> None:
        """Remove what earlier (dead) writers left in the part: their generations' directories (fenced:
        see :mod:`dflash_cache.fence`) and files of the older single-directory layout. Never runs on a
        committed part; never touches this or a newer generation, lease files or seals."""
        if self.storage.exists(f"{self.key}/{COMMIT}"):
            raise PartCommittedError(f"part {self.key} is already committed; a part is written once")
        mine = self.generation
        for name in self.storage.list_dir(self.key):
            g = gen_of(name)
            if g is not None:
                if g.superseded_by(mine):
                    discard_generation(self.storage, self.key, g)
            elif not (is_lease_file(name) or seal_gen(name) is not None or name in ("zarr.json", COMMIT)):
                self.storage.remove_entry(f"{self.key}/{name}")


def _newest_number(storage: Storage, key: str) -> tuple[int, Holder | None]:
    """``(number, holder)``: the holder of the newest lease file, and the highest number of any lease file,
    generation directory or seal in the part, so that the next lease is numbered above every generation
    left in it (their order then tells a leftover from a newer holder's generation)."""
    gen, holder = newest(storage, key)
    for name in storage.list_dir(key):
        g = gen_of(name) or seal_gen(name)
        if g is not None:
            gen = max(gen, g.number)
    return gen, holder


def acquire(storage: Storage, key: str, timeout_s: float = LEASE_TIMEOUT_S) -> PartLease:
    """Take part ``key`` for writing. Raises :class:`PartCommittedError` when it is committed and
    :class:`LeaseHeldError` when a live process holds it."""
    def not_committed() -> None:  # (also after a success: committed by the previous holder just before we looked)
        if storage.exists(f"{key}/{COMMIT}"):
            raise PartCommittedError(f"part {key} is already committed; a part is written once")

    try:
        lease, holder = locks.take_generation(lambda gen: PartLease(storage, key, gen, timeout_s),
                                              lambda: _newest_number(storage, key),
                                              lambda h: _live(storage, h, timeout_s), not_committed)
    except Contended as err:
        if err.holder is not None:  # a live holder (the one that won the race, if this process lost one)
            raise LeaseHeldError(key, err.holder) from None  # type: ignore[arg-type]
        raise CacheError(f"part {key}: other processes took its lease and gave it back again on each of this "
                         "process's tries (nobody holds it now); rerun the command") from None
    if holder is not None:
        log.info("took over part %s from %s (gone)", key, holder.describe())  # type: ignore[attr-defined]
    try:
        from .recover import resolve_sealed  # (on use: it reads arrays, so it loads numpy and torch)

        committed = resolve_sealed(storage, key, lease.generation)  # a writer that stopped between seal and commit
    except BaseException:
        lease.release()
        raise
    if committed:
        lease.release()
        raise PartCommittedError(f"part {key} is already committed; a part is written once")
    return lease  # type: ignore[return-value]


def acquire_committed(storage: Storage, key: str, timeout_s: float = LEASE_TIMEOUT_S) -> PartLease:
    """Take the lease of a part that may be committed (to repair a commit record that names a missing
    generation, :meth:`~dflash_cache.store.FeatureCache.reopen_lost_parts`); no sealed generation is
    resolved. Raises :class:`LeaseHeldError` when a live process holds it."""
    try:
        lease, _ = locks.take_generation(lambda gen: PartLease(storage, key, gen, timeout_s),
                                         lambda: _newest_number(storage, key), lambda h: _live(storage, h, timeout_s))
    except Contended as err:
        if err.holder is not None:
            raise LeaseHeldError(key, err.holder) from None  # type: ignore[arg-type]
        raise CacheError(f"part {key}: other processes took its lease and gave it back again on each of this "
                         "process's tries (nobody holds it now); rerun the command") from None
    return lease  # type: ignore[return-value]


def _beat_failed(lease: PartLease, err: OSError) -> None:
    log.warning("could not refresh the lease of part %s: %s", lease.key, err)


class _Keeper(Keeper):
    """The heartbeat thread of this process: rewrites every held lease every HEARTBEAT_S."""

    def __init__(self) -> None:
        super().__init__(lambda: HEARTBEAT_S, "dflash-lease-heartbeat", _beat_failed)


_keeper = _Keeper()

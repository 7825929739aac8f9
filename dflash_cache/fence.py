"""Fencing: a writer that lost its part can write nothing that the part's owner or a reader uses.

Each writer writes only under its own generation's directory ``<part>/g<number>-<token>/`` (its lease
number and its lease token: :class:`~dflash_cache.parts.Generation`, never reused for a part, not after
``gc`` removed the part's directory and lease numbers start again). The commit record names the
generation that readers open, so the files of any other generation -- a writer that was frozen past its
lease and then resumed, on any host -- are garbage that nothing reads and that ``gc`` removes.

Removing another generation's files races only with that generation committing. Both sides claim
the generation's *seal* ``<part>/g<number>-<token>.seal`` with an exclusive create first: the writer seals
``commit`` just before it creates the commit record, a remover seals ``dead`` before it deletes.
Whoever is first wins; the loser backs off (the writer drops its copy with a clear error, the
remover leaves the directory alone). Once a part has a commit record nobody else can commit it, so
every other generation is removed without a seal.

The commit seal carries the commit record the writer is about to create (``commit\n<record>``). A
writer that dies (or loses its lease) between its seal and its commit record leaves a sealed,
uncommitted generation; the part's next lease holder (a rerun, a takeover, ``gc``) resolves it when it
takes the lease (:mod:`dflash_cache.recover`): it commits the generation with the sealed record when
the data verifies against that record, and removes it otherwise.
"""

from __future__ import annotations

import logging

from .parts import COMMIT, Generation, gen_of
from .storage import Storage

log = logging.getLogger(__name__)

SEAL_COMMIT = b"commit"
SEAL_DEAD = b"dead"
_SEAL_SUFFIX = ".seal"


def seal_key(key: str, gen: Generation) -> str:
    return f"{key}/{gen.dir}{_SEAL_SUFFIX}"


def seal_gen(name: str) -> Generation | None:
    """The generation of a seal file name (``g000003-<token>.seal``), else None."""
    return gen_of(name[: -len(_SEAL_SUFFIX)]) if name.endswith(_SEAL_SUFFIX) else None


def commit_seal(record: bytes) -> bytes:
    """The content of a commit seal: ``commit``, then the commit record the writer is about to create."""
    return SEAL_COMMIT + b"\n" + record if record else SEAL_COMMIT


def is_commit_seal(raw: bytes) -> bool:
    return raw == SEAL_COMMIT or raw.startswith(SEAL_COMMIT + b"\n")


def sealed_record(raw: bytes) -> bytes | None:
    """The commit record inside a commit seal (None: a seal without one, or not a commit seal)."""
    return raw[len(SEAL_COMMIT) + 1:] if raw.startswith(SEAL_COMMIT + b"\n") else None


def seal_for_commit(storage: Storage, key: str, gen: Generation, record: bytes = b"") -> bool:
    """Claim generation ``gen`` of part ``key`` for a commit with ``record``. False: a remover declared
    it dead first."""
    if storage.create_exclusive(seal_key(key, gen), commit_seal(record), durable=True):
        return True
    try:
        return is_commit_seal(storage.get(seal_key(key, gen)))  # (sealed by this writer before: a retry)
    except FileNotFoundError:
        return False


def commit_sealed(storage: Storage, key: str) -> list[Generation]:
    """Generations of part ``key`` sealed for a commit (whether or not they were committed)."""
    out = []
    for name in storage.list_dir(key):
        g = seal_gen(name)
        if g is None:
            continue
        try:
            if is_commit_seal(storage.get(f"{key}/{name}")):
                out.append(g)
        except FileNotFoundError:
            continue
    return sorted(out, key=lambda g: (g.number, g.token))


def discard_generation(storage: Storage, key: str, gen: Generation) -> bool:
    """Remove the files of generation ``gen`` of an uncommitted part unless its writer sealed it for a
    commit. True when removed (or already gone)."""
    if not storage.create_exclusive(seal_key(key, gen), SEAL_DEAD):
        try:
            if storage.get(seal_key(key, gen)) != SEAL_DEAD:
                return False  # its writer is committing it (or died between its seal and its commit record)
        except FileNotFoundError:
            return False
    storage.remove_entry(f"{key}/{gen.dir}")
    return True


def garbage_of_committed(storage: Storage, key: str, committed_gen: Generation | None) -> list[str]:
    """Names in a committed part's directory that no reader uses: other generations' directories and
    seals (late writers), lease files. Only valid once ``key`` has a commit record."""
    out = []
    for name in storage.list_dir(key):
        g = gen_of(name)
        s = seal_gen(name)
        if (g is not None and g != committed_gen) or (s is not None and s != committed_gen) \
                or (name.startswith("lease.") and name.endswith(".json")):
            out.append(name)
    return out


def remove_garbage_of_committed(storage: Storage, key: str, committed_gen: Generation | None) -> list[str]:
    """Remove :func:`garbage_of_committed`; returns the keys removed."""
    if not storage.exists(f"{key}/{COMMIT}"):
        return []
    removed = []
    for name in garbage_of_committed(storage, key, committed_gen):
        storage.remove_entry(f"{key}/{name}")
        removed.append(f"{key}/{name}")
    if removed:
        log.debug("removed %d late writer file(s) of committed part %s", len(removed), key)
    return removed


def remove_dead_seals(storage: Storage, key: str) -> None:
    """Remove the ``dead`` seals of generations whose files are gone (``gc``, holding the part's lease:
    a late writer that seals afterwards still finds its lease gone and stops)."""
    names = set(storage.list_dir(key))
    for name in names:
        g = seal_gen(name)
        if g is None or g.dir in names:
            continue
        try:
            if storage.get(f"{key}/{name}") == SEAL_DEAD:
                storage.remove(f"{key}/{name}")
        except FileNotFoundError:
            continue

"""``verify``: check everything a reader of the cache trusts.

- the head (``head.safetensors``) against the checksum in the root metadata, and its shapes;
- every committed part against its commit record (arrays, counts, offsets, checksums, finiteness);
- the work units of the extraction: every part a unit's records name is committed and the unit
  holds the samples its records count. A unit that lacks a part (an uncommitted part of a unit whose
  writer is gone, or no part at all) is *unfinished* while the extraction has not finished -- resumable,
  not damage -- and a lost commit record once it has;
- the extraction's state (:mod:`dflash_cache.extraction`): "extraction not finished: N of M units";
- the extraction's final report (``meta/extract_report.json``) against the committed samples;
- no sample id in two places.

Every problem is collected (one line per part, however many checks it fails); nothing stops at the
first. Problems are damage (``dflash-cache verify`` exits 2); an unfinished extraction without damage
exits 3.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .errors import CacheCorruptError
from .extraction import FINISH, REPORT, ExtractionState, extraction_state
from .fence import commit_sealed, garbage_of_committed, seal_gen, seal_key
from .head import HEAD_KEY, decode_head
from .lease import live_holder
from .part_checks import PartCheckError, check_part_arrays
from .parts import COMMIT, PartInfo, gen_of, part_key
from .storage import Storage
from .store import FeatureCache, open_cache

log = logging.getLogger(__name__)

EXTRACT_REPORT = REPORT
_RERUN = "rerun dflash-extract with the same config and --out: it rewrites missing parts and keeps the others"
_REWRITE = "delete the part's directory and rerun dflash-extract with the same config and --out to rewrite it"


@dataclass
class Problem:
    part: str | None  # None: not a part (the head, the extraction report)
    array: str
    message: str

    def __str__(self) -> str:
        where = f"part {self.part}, array {self.array}" if self.part is not None else self.array
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    n_parts: int = 0
    n_samples: int = 0
    n_tokens: int = 0
    problems: list[Problem] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    being_written: list[str] = field(default_factory=list)  # uncommitted parts whose writer is live
    garbage: list[str] = field(default_factory=list)  # late writers' files in committed parts (nothing reads them)
    stray: list[str] = field(default_factory=list)  # files where only part directories belong
    unknown: list[str] = field(default_factory=list)  # entries in committed parts that their record does not name
    sealed: list[str] = field(default_factory=list)  # uncommitted parts whose writer sealed a generation, then stopped
    extraction: ExtractionState | None = None  # the extraction's plan and progress (dflash_cache.extraction)
    unfinished: list[str] = field(default_factory=list)  # units not complete yet (resumable: no damage), one line each

    @property
    def finished(self) -> bool:
        """Nothing is left to extract: the extraction finished (or the cache was not written by one) and no
        unit lacks a part."""
        return not self.unfinished and not (self.extraction is not None and self.extraction.unfinished)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, part: str | None, array: str, message: str) -> None:
        """Record a problem; a part already listed gets the message appended (each part is named once)."""
        for p in self.problems:
            if part is not None and p.part == part:
                p.message += f"; also {array}: {message}"
                return
        self.problems.append(Problem(part, array, message))

    def summary(self) -> str:
        if self.ok:
            s = f"{self.n_parts} parts, {self.n_samples} samples, {self.n_tokens} tokens: all checks pass"
        else:  # the counts are of the parts that passed
            s = (f"{self.n_parts} parts checked: {len(self.problems)} problem(s); the parts that pass hold "
                 f"{self.n_samples} samples, {self.n_tokens} tokens")
        if self.extraction is not None and (self.extraction.status != "none" or self.unfinished):
            s += f"; {self.extraction.describe()}"
        if self.unfinished:
            s += f" ({len(self.unfinished)} unit(s) started and not complete: resumable, {FINISH})"
        if self.being_written:
            s += f"; {len(self.being_written)} part(s) being written by a live extraction"
        listed = {p.part for p in self.problems}
        left = len([k for k in self.uncommitted if k not in self.being_written and k not in listed])
        if left:
            s += f"; {left} uncommitted leftover(s) (dflash-cache gc removes them)"
        if self.garbage:
            s += (f"; {len(self.garbage)} file(s) of writers that lost their part, never read "
                  "(dflash-cache gc removes them)")
        if self.stray:
            s += f"; {len(self.stray)} stray file(s) ignored by readers: {', '.join(self.stray[:3])}"
        if self.unknown:
            s += (f"; {len(self.unknown)} unknown file(s) in committed parts ignored by readers: "
                  f"{', '.join(self.unknown[:3])}")
        return s

    def leftovers(self) -> list[str]:
        """One line per entry that readers ignore (what it is, and whether ``dflash-cache gc`` removes it)."""
        lines = list(self.unfinished)
        for key in self.sealed:
            lines.append(f"{key}: uncommitted, but its writer sealed a generation for its commit and stopped before "
                         "the commit record; `dflash-cache gc` (or rerunning the extraction) commits it if it "
                         "verifies, and removes it otherwise")
        for key in self.garbage:
            name = key.rsplit("/", 1)[-1]
            what = ("the seal of a generation that its commit record does not name" if seal_gen(name) is not None
                    else "a generation that its commit record does not name (a writer that lost the part, or died)")
            lines.append(f"{key}: {what}; never read; `dflash-cache gc` removes it")
        for key in self.unknown:
            lines.append(f"{key}: not named by the part's commit record; never read (training ignores it); "
                         "`dflash-cache gc` leaves it: remove it by hand")
        for key in self.stray:
            lines.append(f"{key}: a file where only part directories belong; never read; `dflash-cache gc` leaves "
                         "it: remove it by hand")
        return lines


def unknown_entries(storage: Storage, part: PartInfo) -> list[str]:
    """Keys in committed part ``part`` that neither the commit protocol nor its commit record names (an extra
    file in its generation, an array or chunk the record does not list, a partial write): nothing reads
    them. Other generations and seals are :func:`~dflash_cache.fence.garbage_of_committed`, lease files
    are the protocol's own."""
    key = part.key
    known = {COMMIT, "zarr.json", *garbage_of_committed(storage, key, part.gen)}
    known |= {part.gen.dir, seal_key(key, part.gen).rsplit("/", 1)[-1]} \
        if part.gen is not None else set(part.arrays)
    out = [f"{key}/{name}" for name in storage.list_dir(key) if name not in known]
    grids: dict[str, list[int] | None] = {}
    for k in sorted(storage.list_files(part.data_key)):
        rel = k[len(part.data_key) + 1:].split("/")
        if rel == ["zarr.json"] or (part.generation is None and rel[0] not in part.arrays):
            continue  # (the single-directory layout: what is not an array was judged above)
        if rel[0] not in part.arrays or len(rel) < 2:
            out.append(k)
            continue
        if rel[1:] == ["zarr.json"]:
            continue
        if rel[0] not in grids:
            grids[rel[0]] = _chunk_grid(storage, f"{part.data_key}/{rel[0]}")
        grid, idx = grids[rel[0]], rel[2:]
        if rel[1] != "c" or not all(i.isdigit() for i in idx) or (
                grid is not None and (len(idx) != len(grid) or any(int(i) >= n for i, n in zip(idx, grid, strict=True)))):
            out.append(k)
    return out


def _chunk_grid(storage: Storage, array_key: str) -> list[int] | None:
    """Chunks per dimension of the array at ``array_key`` (None: its metadata cannot tell; other checks
    report that)."""
    try:
        meta = json.loads(storage.get(f"{array_key}/zarr.json"))
        shape, chunks = meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]
        return [-(-int(n) // max(int(c), 1)) for n, c in zip(shape, chunks, strict=True)]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _check_groups(cache: FeatureCache, report: VerifyReport) -> None:
    """The group documents that zarr-python needs to walk from the root to the parts."""
    for key in ["buckets/zarr.json", *(f"buckets/{b}/zarr.json" for b in range(cache.spec.n_buckets))]:
        if not cache.storage.exists(key):
            report.add(None, key, "missing (zarr readers cannot open the cache below it); rerun dflash-extract with "
                       "the same config and --out to restore it (it keeps the parts)")


def _check_head(cache: FeatureCache, report: VerifyReport) -> None:
    try:
        raw = cache.storage.get(HEAD_KEY)
    except FileNotFoundError:
        raw = None
    problem = cache.head_problem(raw)
    if problem is None:
        try:
            decode_head(raw, cache.spec)  # type: ignore[arg-type]
        except CacheCorruptError as err:
            problem = str(err)
    if problem is not None:
        report.add(None, HEAD_KEY, problem)


def _leftover_unit(storage: Storage, key: str) -> int | None:
    """The work unit an uncommitted part belongs to (from its group attributes), if any."""
    gens = sorted((g.number, n) for n in storage.list_dir(key) if (g := gen_of(n)) is not None)
    where = f"{key}/{gens[-1][1]}" if gens else key
    try:
        meta = json.loads(storage.get(f"{where}/zarr.json")).get("attributes", {}).get("meta", {})
        return int(meta["unit"])
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _check_units(cache: FeatureCache, parts: list[PartInfo], report: VerifyReport) -> None:
    """Each unit's committed parts against the unit's own records (``unit_parts``, ``unit_buckets``,
    ``unit_stats``), and uncommitted parts of units whose writer is gone. A unit that lacks parts is
    *unfinished* (resumable: the rerun writes what is missing) while the extraction has not finished, and
    damage (a lost commit record) once it has."""
    finished = report.extraction is not None and report.extraction.status == "finished"

    def incomplete(key: str, array: str, msg: str) -> None:
        if finished:
            report.add(key, array, f"{msg}; {_RERUN}")
        else:
            report.unfinished.append(f"{key}: {msg} (the extraction has not finished: {FINISH})")

    units: dict[int, list[PartInfo]] = defaultdict(list)
    for p in parts:
        if "unit" in p.meta:
            units[int(p.meta["unit"])].append(p)
    for u, mine in sorted(units.items()):
        meta = mine[0].meta
        want_parts = int(meta.get("unit_parts", len(mine)))
        if len(mine) < want_parts:
            have = {p.bucket for p in mine}
            missing = [b for b in meta.get("unit_buckets", []) if b not in have]
            msg = (f"work unit {u} is incomplete: {len(mine)} of its {want_parts} parts are committed and this "
                   "one has no commit record")
            listed = {p.part for p in report.problems}
            for b in missing:
                if part_key(b, mine[0].name) not in listed:  # (an unreadable record is reported already)
                    incomplete(part_key(b, mine[0].name), COMMIT, msg)
            if not missing:
                incomplete(mine[0].key, "meta", msg.replace("this one", "another (bucket unknown)"))
            continue
        want = (meta.get("unit_stats") or {}).get("n_samples")
        got = sum(p.n_samples + int(p.meta.get("n_nonfinite", 0)) for p in mine)
        if want is not None and got != int(want):
            report.add(mine[0].key, "meta", f"work unit {u} holds {got} samples (non-finite skips included) but "
                       f"its records count {want}; {_RERUN} after deleting the unit's part directories")
    for key in report.uncommitted:
        holder = live_holder(cache.storage, key)
        if holder is not None:
            report.being_written.append(key)
            continue
        u = _leftover_unit(cache.storage, key)
        if u is not None and key not in {p.part for p in report.problems} | {ln.split(":")[0] for ln in report.unfinished}:
            incomplete(key, COMMIT, f"work unit {u} is incomplete: this part has no commit record and no live "
                       "writer (the extraction stopped before committing it, or the record was lost)")


def _check_extract_report(cache: FeatureCache, parts: list[PartInfo], report: VerifyReport) -> None:
    try:
        rec = json.loads(cache.storage.get(EXTRACT_REPORT))
    except FileNotFoundError:
        return
    except ValueError:
        report.add(None, EXTRACT_REPORT, "not valid JSON; rerun dflash-extract with the same config and --out")
        return
    want = rec.get("samples_in_cache")
    got = sum(p.n_samples for p in parts)
    if want is not None and got < int(want):
        report.add(None, EXTRACT_REPORT, f"the finished extraction counted {int(want)} samples in the cache, its "
                   f"committed parts hold {got}: parts were removed or lost their commit record; {_RERUN}")


def _check_parts_in_parallel(cache: Any, parts: list[Any], threads: int | None) -> list[Any]:
    """``check_part_arrays`` of every part on ``threads`` threads (decoding releases the GIL; remote stores
    overlap their requests); each result is the part's small arrays or the exception it raised, in
    ``parts`` order, so the report reads the same whatever the thread count."""
    def one(part: Any) -> Any:
        try:
            return check_part_arrays(cache.storage, part, cache.bucket_bounds(part.bucket))
        except (PartCheckError, CacheCorruptError) as err:
            return err

    n = threads or (min(8, os.cpu_count() or 1) if cache.storage.is_local else 16)
    if n <= 1 or len(parts) <= 1:
        return [one(p) for p in parts]
    with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="dflash-verify") as pool:
        return list(pool.map(one, parts))


def verify_cache(url: str, storage: Storage | None = None, raise_on_error: bool = True,
                 threads: int | None = None) -> VerifyReport:
    """Check the cache (see the module docstring); raises :class:`CacheCorruptError` naming the first
    part and array at fault (the message lists every problem) unless ``raise_on_error`` is False.
    Parts are checked on ``threads`` threads (unset: up to 8 locally, 16 on a remote store)."""
    cache = open_cache(url, storage=storage)
    report = VerifyReport(uncommitted=cache.uncommitted(), stray=cache.stray_files())
    report.sealed = [k for k in report.uncommitted if commit_sealed(cache.storage, k)]
    _check_head(cache, report)
    _check_groups(cache, report)
    parts, bad_records = cache.scan_parts()
    for err in bad_records:
        report.add(err.part, err.array or COMMIT, _reason(err))
    seen: dict[int, str] = {}
    checked = _check_parts_in_parallel(cache, parts, threads)
    for part, result in zip(parts, checked, strict=True):
        report.n_parts += 1
        report.garbage += [f"{part.key}/{n}" for n in garbage_of_committed(cache.storage, part.key, part.gen)
                           if not n.startswith("lease.")]
        report.unknown += unknown_entries(cache.storage, part)
        try:
            if isinstance(result, BaseException):
                raise result
            small = result
        except PartCheckError as err:
            report.add(part.key, err.array, f"{err.message}; {_REWRITE}")
            continue
        except CacheCorruptError as err:
            report.add(part.key, err.array or "?", _reason(err))
            continue
        report.n_samples += part.n_samples
        report.n_tokens += part.n_tokens
        _check_duplicates(report, seen, small["sample_ids"], part.key)
    report.extraction = extraction_state(cache.storage, parts)
    _check_units(cache, parts, report)
    if not any(p.part is not None for p in report.problems):  # (else those problems explain a shortfall)
        _check_extract_report(cache, parts, report)
    if report.problems and raise_on_error:
        first = report.problems[0]
        listing = "\n  ".join(str(p) for p in report.problems)
        raise CacheCorruptError(f"{url}: verify found {len(report.problems)} problem(s):\n  {listing}",
                                part=first.part, array=first.array)
    return report


def _reason(err: CacheCorruptError) -> str:
    """A reader's error as a verify line: without the part/array prefix (the line names them) and with
    verify's advice instead of the reader's."""
    msg = str(err)
    for prefix in (f"part {err.part}, array {err.array}: ", f"part {err.part}: "):
        msg = msg.removeprefix(prefix)
    return f"{msg.split('; run `dflash-cache verify`')[0]}; {_REWRITE}"


def _check_duplicates(report: VerifyReport, seen: dict[int, str], ids: Any, key: str) -> None:
    for sid in ids.tolist():
        other = seen.setdefault(int(sid), key)
        if other != key:
            report.add(key, "sample_ids", f"sample id {sid} is also in part {other}")
            return

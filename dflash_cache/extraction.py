"""What a cache records about the extraction that writes it, and whether that extraction has finished.

``dflash-extract`` records

- its plan, ``meta/extract_plan.json`` (the number of work units and their size), when it opens the cache,
  before it writes any part (every job on one ``--out`` writes the same plan: the data and the settings
  that decide it are part of the cache's spec);
- each unit that kept no sample (nothing to commit), ``meta/empty_units/u<unit>.json``;
- its report, ``meta/extract_report.json``, once every unit of the plan is complete.

A unit is complete when every part its records name is committed, or when it kept no sample. From these:

- **finished**: the report is there (all units of the plan were complete when it was written);
- **unfinished**: a plan without a report (killed, preempted, a disk full, still running): "N of M units";
  a cache written by ``dflash-extract`` before plans were recorded (it has the resolved config,
  ``meta/config.json``, but no plan) and no report is unfinished too, with M unknown;
- **not an extraction**: none of the three (a cache written through the library, e.g. the synthetic test
  caches): whoever wrote it decides when it is complete, and nothing here claims either way.

``dflash-cache info`` and ``verify`` print the state; ``verify`` exits 3 on an unfinished extraction that
holds no damage (2 is damage), and ``dflash-train`` refuses an unfinished cache outside live mode unless
``loader.allow_unfinished`` is set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from .parts import PartInfo
from .storage import Storage

PLAN = "meta/extract_plan.json"
REPORT = "meta/extract_report.json"
CONFIG = "meta/config.json"
EMPTY_UNITS = "meta/empty_units"
FINISH = "rerun the same dflash-extract command (its resolved config is in CACHE/meta/config.json) to finish it"


@dataclass(frozen=True)
class ExtractionState:
    """``status``: finished / unfinished / none (not written by ``dflash-extract``); ``units_total``: the
    plan's unit count (None: no plan recorded); ``units_complete``: units complete now."""

    status: Literal["finished", "unfinished", "none"]
    units_total: int | None
    units_complete: int

    @property
    def unfinished(self) -> bool:
        return self.status == "unfinished"

    def describe(self) -> str:
        if self.status == "finished":
            total = f"{self.units_total} units" if self.units_total is not None else "written before plans were recorded"
            return f"extraction finished ({total})"
        if self.status == "none":
            return "no extraction record (not written by dflash-extract): completeness is up to its writer"
        if self.units_total is None:
            return (f"extraction not finished: {self.units_complete} units complete, of a plan not recorded (written "
                    "by a dflash-extract from before plans were recorded)")
        return f"extraction not finished: {self.units_complete} of {self.units_total} units"


def write_plan(storage: Storage, n_units: int, unit_size: int, n_records: int) -> None:
    """Record the extraction's plan (the same bytes from every job on one cache: a plain put)."""
    storage.put(PLAN, json.dumps({"n_units": n_units, "unit_size": unit_size, "n_records": n_records},
                                 indent=1, sort_keys=True).encode(), durable=True)


def mark_empty_unit(storage: Storage, unit: int) -> None:
    """Record that work unit ``unit`` kept no sample: it is complete without a part."""
    storage.put(f"{EMPTY_UNITS}/u{unit:07d}.json", json.dumps({"unit": unit}).encode(), durable=True)


def empty_units(storage: Storage) -> set[int]:
    out = set()
    for name in storage.list_dir(EMPTY_UNITS):
        if name.startswith("u") and name.endswith(".json") and name[1:-5].isdigit():
            out.add(int(name[1:-5]))
    return out


def complete_units(parts: Iterable[PartInfo]) -> set[int]:
    """Units of which every part their records name (``unit_parts``) is committed."""
    want: dict[int, int] = {}
    have: dict[int, set[int]] = {}
    for p in parts:
        if "unit" in p.meta:
            u = int(p.meta["unit"])
            want[u] = int(p.meta.get("unit_parts", 1))
            have.setdefault(u, set()).add(p.bucket)
    return {u for u, n in want.items() if len(have[u]) >= n}


def _read_json(storage: Storage, key: str) -> dict | None:
    try:
        rec = json.loads(storage.get(key))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}  # unreadable: present (verify names the damage)
    return rec if isinstance(rec, dict) else {}


def extraction_state(storage: Storage, parts: Iterable[PartInfo] | Callable[[], Iterable[PartInfo]]
                     ) -> ExtractionState:
    """The state of the extraction writing the cache in ``storage``, whose committed parts are ``parts`` (or
    what calling it returns: only an unfinished extraction needs them)."""
    plan = _read_json(storage, PLAN)
    total = None
    if plan is not None:
        try:
            total = int(plan["n_units"])
        except (KeyError, TypeError, ValueError):
            total = None
    if storage.exists(REPORT):
        return ExtractionState("finished", total, total if total is not None else 0)
    if plan is None and not storage.exists(CONFIG):
        return ExtractionState("none", None, 0)
    done = complete_units(parts() if callable(parts) else parts) | empty_units(storage)
    if total is not None:
        done = {u for u in done if u < total}
    return ExtractionState("unfinished", total, len(done))

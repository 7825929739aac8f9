"""``dflash-cache``: inspect (info), check (verify) and clean (gc) a feature cache."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from dflash_cache.errors import UsageError
from dflash_cache.extraction import FINISH
from dflash_cache.lease import HEARTBEAT_S, LEASE_TIMEOUT_MIN_S, LEASE_TIMEOUT_S
from dflash_cache.runtime.entry import finite_float, run_cli

UNFINISHED_EXIT = 3  # verify: no damage, but the extraction has not finished (2: damage)


def cache_summary(url: str) -> dict[str, Any]:
    """The ``info --json`` document."""
    from dflash_cache.extraction import extraction_state
    from dflash_cache.store import open_cache

    cache = open_cache(url)
    parts = cache.parts()
    n_tokens = sum(p.n_tokens for p in parts)
    state = extraction_state(cache.storage, parts)
    buckets = []
    for b in range(cache.spec.n_buckets):
        lo, hi = cache.bucket_bounds(b)
        mine = [p for p in parts if p.bucket == b]
        buckets.append({"lo": lo, "hi": hi, "n_samples": sum(p.n_samples for p in mine),
                        "n_tokens": sum(p.n_tokens for p in mine)})
    return {
        "n_samples": sum(p.n_samples for p in parts),
        "n_tokens": n_tokens,
        "bytes_per_token": (sum(p.feature_bytes for p in parts) / n_tokens) if n_tokens else 0.0,
        "raw_bytes_per_token": 2 * cache.spec.feature_dim,
        "buckets": buckets,
        "codec": cache.spec.codec,
        "teacher": cache.spec.to_dict()["teacher"],
        "target_layer_ids": list(cache.spec.target_layer_ids),
        "final_hidden": cache.spec.final_hidden,  # the teacher's final normed state stored (last feature slot)
        "mask_token_id": cache.spec.mask_token_id,  # None: a cache written before it was recorded
        "mask_token_source": cache.spec.mask_token_source,
        "fingerprint": cache.spec.fingerprint,
        "uncommitted_parts": cache.uncommitted(),
        "extraction": {"status": state.status, "units_total": state.units_total,
                       "units_complete": state.units_complete, "summary": state.describe()},
    }


def _print_info(info: dict[str, Any]) -> None:
    t = info["teacher"]
    ratio = info["bytes_per_token"] / info["raw_bytes_per_token"] if info["raw_bytes_per_token"] else 0
    rev = f"revision {t['revision']}, " if t.get("revision") else ""
    print(f"teacher      {t['name_or_path']} ({rev}{t['num_layers']} layers, hidden {t['hidden_size']}, "
          f"vocab {t['vocab_size']}, {t['dtype']})")
    print(f"layers       {info['target_layer_ids']}")
    print("final state  " + ("stored (last feature slot): distribution losses can train on this cache"
                             if info["final_hidden"] else
                             "not stored (extract with cache.store_final_hidden = true for distribution losses)"))
    mask = (f"{info['mask_token_id']} (from the {info['mask_token_source']})" if info["mask_token_id"] is not None
            else "not recorded (set model.mask_token_id to train on this cache)")
    print(f"mask token   {mask}")
    print(f"codec        {info['codec']}   fingerprint {info['fingerprint']}")
    print(f"samples      {info['n_samples']}   tokens {info['n_tokens']}")
    print(f"bytes/token  {info['bytes_per_token']:.1f} on disk, {info['raw_bytes_per_token']} raw bf16 ({ratio:.3f})")
    for b in info["buckets"]:
        print(f"  bucket ({b['lo']}, {b['hi']}]: {b['n_samples']} samples, {b['n_tokens']} tokens")
    left = info["uncommitted_parts"]
    print(f"uncommitted  {len(left)}" + (f": {', '.join(left)}" if left else ""))
    x = info["extraction"]
    print(f"extraction   {x['summary']}" + (f"; {FINISH}" if x["status"] == "unfinished" else ""))


def _cmd_info(args: argparse.Namespace) -> int:
    info = cache_summary(args.cache)
    if args.json:
        info.pop("teacher")
        print(json.dumps(info, indent=1))
    else:
        _print_info(info)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from dflash_cache.verify import verify_cache

    report = verify_cache(args.cache, raise_on_error=False)
    print(report.summary())
    for line in report.leftovers():
        print(f"  {line}")
    if report.ok and not report.finished:  # no damage, but not all there: resumable, not corrupt
        what = (report.extraction.describe() if report.extraction is not None and report.extraction.unfinished
                else f"{len(report.unfinished)} work unit(s) started and not complete")
        print(f"error: {args.cache}: {what}; no damage found; {FINISH.replace('CACHE', args.cache)}", file=sys.stderr)
        return UNFINISHED_EXIT
    if report.ok:
        return 0
    print(f"error: {args.cache}: verify found {len(report.problems)} problem(s), one line per part:", file=sys.stderr)
    for problem in report.problems:
        print(f"  {problem}", file=sys.stderr)
    return 2


def _cmd_gc(args: argparse.Namespace) -> int:
    from dflash_cache.store import open_cache

    if args.min_age < LEASE_TIMEOUT_MIN_S:
        raise UsageError(f"--min-age {args.min_age:g} is below {LEASE_TIMEOUT_MIN_S:.0f} s: writers refresh their "
                         f"leases every {HEARTBEAT_S:.0f} s, so gc would take parts from live writers whose heartbeat "
                         f"is merely late; use at least {LEASE_TIMEOUT_MIN_S:.0f}, or `dflash-cache release CACHE "
                         "--host NAME` for a host known dead")
    removed = open_cache(args.cache).gc(min_age_s=args.min_age, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(removed)} uncommitted part(s)" + "".join(f"\n  {k}" for k in removed))
    return 0


def _cmd_release(args: argparse.Namespace) -> int:
    from dflash_cache.lease import release_host
    from dflash_cache.store import open_cache

    cache = open_cache(args.cache)
    keys = cache.uncommitted()
    released = release_host(cache.storage, args.host, keys, force=args.force)
    print(f"declared the leases of host {args.host} dead: {len(released)} part(s) can be taken over now"
          + "".join(f"\n  {k}" for k in released))
    return 0


_SUBCOMMANDS = {
    "info": "Print what a cache holds: samples, tokens, bytes per token on disk against raw bf16, length buckets, "
            "codec, teacher, layers, fingerprint, and uncommitted leftovers.",
    "verify": "Re-read the frozen head and every committed part (checksums, shapes, offsets, id uniqueness, "
              "finiteness) and check that every work unit is complete; list every bad part and exit 2 on any "
              "fault; exit 3 when nothing is damaged but the extraction has not finished (N of M units).",
    "gc": "Remove the uncommitted leftovers of writers that are gone.",
    "release": "Declare a dead host's part leases dead now, so that running or rerun jobs take its parts over at "
               "once instead of after extract.lease_timeout_s; refused while that host's heartbeat is fresh.",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-cache", description="Inspect, check and clean a dflash feature cache "
                                "written by dflash-extract (docs/cache.md).")
    sub = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND", help="one of:")

    def add(name: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=_SUBCOMMANDS[name], description=_SUBCOMMANDS[name])
        sp.add_argument("cache", help="cache path or fsspec URL")
        return sp

    info = add("info")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(fn=_cmd_info)
    add("verify").set_defaults(fn=_cmd_verify)
    gc = add("gc")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
    gc.add_argument("--min-age", type=finite_float, default=LEASE_TIMEOUT_S,
                    help="leftovers of writers on other hosts count as abandoned when their lease heartbeat is older "
                         "than this many seconds, at least 90 (3 heartbeats; writers on this host: when their process "
                         "is gone)")
    gc.set_defaults(fn=_cmd_gc)
    rel = add("release")
    rel.add_argument("--host", required=True, help="the host name in the lease records (dflash-cache info lists "
                     "live writers; a process's host is its hostname, or DFLASH_HOST_ID when set)")
    rel.add_argument("--force", action="store_true", help="release even though the host wrote a heartbeat in the "
                     "last two heartbeat intervals")
    rel.set_defaults(fn=_cmd_release)
    return p


def _main(argv: Sequence[str] | None) -> int | None:
    args = build_parser().parse_args(argv)
    return args.fn(args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

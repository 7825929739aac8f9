"""Part layout: names, keys, the commit record and :class:`PartInfo`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import CacheCorruptError, CacheError

COMMIT = "commit.json"
# a part's own group document (its data is the generation group under it): constant, so any writer may put it
PART_GROUP = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}, indent=1).encode()
LEASE = "writing.json"
FEATURE_ARRAYS = ("features", "scales")  # token-sharded arrays
SMALL_ARRAYS = ("input_ids", "loss_mask", "target_argmax", "offsets", "sample_ids")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_GEN = re.compile(r"^g(\d{6,})(?:-([0-9a-f]{8,64}))?$")


@dataclass(frozen=True)
class Generation:
    """One writer's generation of a part: its lease number and its writer's token (the lease token).

    The number orders generations while a part's lease files exist; the token makes the identity unique
    for ever: after ``gc`` removed a part's directory, or ``release`` declared its writer dead, lease
    numbers may start again from 1, but a new writer's token is new, so a late writer's generation is
    never taken for its successor's (and a late writer removes only files that carry its own token).
    ``token`` is "" for generations written before they carried one (directory ``g000003``)."""

    number: int
    token: str = ""

    @property
    def dir(self) -> str:
        """The directory (inside the part) that this generation's writer writes into."""
        return f"g{self.number:06d}-{self.token}" if self.token else f"g{self.number:06d}"

    def superseded_by(self, holder: Generation) -> bool:
        """This generation predates ``holder`` (the part's lease holder, whose number is above every
        number left in the part when it took the lease): a lower number, or the same number from before
        the part's lease files were removed (another token)."""
        return self.number < holder.number or (self.number == holder.number and self.token != holder.token)


def gen_dir(gen: Generation) -> str:
    """The directory (inside the part) that the writer of generation ``gen`` writes into."""
    return gen.dir


def gen_of(name: str) -> Generation | None:
    """The generation of a part's data directory name (``g000003-<token>``, or ``g000003`` as written
    before generations carried their writer's token), else None."""
    m = _GEN.match(name)
    return Generation(int(m.group(1)), m.group(2) or "") if m else None


def check_part_name(name: str) -> str:
    if not _NAME.match(name):
        raise CacheError(f"part name {name!r} is not allowed: use 1-128 characters from A-Z a-z 0-9 . _ - "
                         "starting with a letter or digit (e.g. 'u000012-r0')")
    return name


def part_key(bucket: int, name: str) -> str:
    return f"buckets/{bucket}/{name}"


@dataclass(frozen=True)
class PartInfo:
    """A committed part, as described by its commit record."""

    bucket: int
    name: str
    n_samples: int
    n_tokens: int
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    codec: str = "bf16-zstd"
    arrays: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)
    chunk_tokens: int = 256
    shard_tokens: int = 16384
    generation: int | None = None  # the writer's lease number; its data is under ``data_key``
    cache_fingerprint: str | None = field(default=None, compare=False)
    writer: str = ""  # the writer's token ("" in records written before generations carried one)

    @property
    def gen(self) -> Generation | None:
        """The generation the record names (None: format 1, the single-directory layout)."""
        return None if self.generation is None else Generation(self.generation, self.writer)

    @property
    def key(self) -> str:
        return part_key(self.bucket, self.name)

    @property
    def data_key(self) -> str:
        """Where the part's zarr group (arrays) lives: ``<key>/g<number>-<writer>`` (``<key>/g<number>`` in
        records of format 2, ``<key>`` in records of format 1, written before writers had a directory of
        their own)."""
        return self.key if self.gen is None else f"{self.key}/{self.gen.dir}"

    @property
    def has_target_argmax(self) -> bool:
        return "target_argmax" in self.arrays

    @property
    def feature_bytes(self) -> int:
        """Bytes on disk of the feature data (features + fp8 scales)."""
        return sum(int(self.arrays[a].get("stored_bytes", 0)) for a in FEATURE_ARRAYS if a in self.arrays)

    def to_record(self, fingerprint: str) -> dict[str, Any]:
        return {
            "format_version": 3 if self.writer else 2, "cache_fingerprint": fingerprint, "bucket": self.bucket,
            "name": self.name, "generation": self.generation, **({"writer": self.writer} if self.writer else {}),
            "n_samples": self.n_samples, "n_tokens": self.n_tokens, "codec": self.codec,
            "chunk_tokens": self.chunk_tokens, "shard_tokens": self.shard_tokens,
            "meta": self.meta, "arrays": self.arrays,
        }

    @classmethod
    def from_record(cls, raw: bytes, key: str) -> PartInfo:
        info = cls._parse(raw, key)
        bad = info.inconsistency()
        if bad:
            raise CacheCorruptError(f"part {key}: commit record {COMMIT} disagrees with itself: {bad}; "
                                    "the part cannot be trusted: delete it and re-extract its work unit",
                                    part=key, array=COMMIT)
        return info

    def inconsistency(self) -> str | None:
        """Why the counts and array shapes of the record disagree, or None."""
        a = self.arrays
        want = {"features": self.n_tokens, "input_ids": self.n_tokens, "loss_mask": self.n_tokens,
                "sample_ids": self.n_samples, "offsets": self.n_samples + 1}
        for name, n in want.items():
            if name not in a:
                return f"array {name} is not listed"
            if int(a[name]["shape"][0]) != n:
                return f"{name} has {a[name]['shape'][0]} rows but the counts say {n}"
        return None

    @classmethod
    def _parse(cls, raw: bytes, key: str) -> PartInfo:
        try:
            rec = json.loads(raw)
            return cls(bucket=int(rec["bucket"]), name=str(rec["name"]), n_samples=int(rec["n_samples"]),
                       n_tokens=int(rec["n_tokens"]), meta=dict(rec.get("meta") or {}), codec=str(rec["codec"]),
                       arrays=dict(rec["arrays"]), chunk_tokens=int(rec["chunk_tokens"]),
                       shard_tokens=int(rec["shard_tokens"]),
                       generation=None if rec.get("generation") is None else int(rec["generation"]),
                       cache_fingerprint=rec.get("cache_fingerprint"), writer=str(rec.get("writer") or ""))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CacheCorruptError(f"part {key}: commit record {COMMIT} is unreadable ({err}); "
                                    "run `dflash-cache verify` and re-extract this part",
                                    part=key, array=COMMIT) from None

"""The typed cache spec stored in the root attributes, its fingerprint and a field-by-field diff."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import CacheError, ConfigError, NotACacheError

if TYPE_CHECKING:
    from .storage import Storage

FORMAT_VERSION = 1
CODECS = ("bf16-zstd", "bf16-lz4", "bf16-raw", "fp8-e4m3")
ATTR_KEY = "dflash_cache"
# Where a cache's mask token came from: "config" (model.mask_token_id, e.g. set by a Qwen3 preset) or
# "tokenizer" (the teacher tokenizer's own mask token).
MASK_TOKEN_SOURCES = ("config", "tokenizer")
# Recorded for people, not part of compatibility: left out of the fingerprint.
_PROVENANCE = ("mask_token_source",)


@dataclass(frozen=True)
class TeacherInfo:
    """Identity of the model whose hidden states the cache holds."""

    name_or_path: str
    revision: str | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"TeacherInfo.{name} must be a positive integer, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CacheSpec:
    """Everything that makes two caches compatible. ``fingerprint`` hashes all of it."""

    teacher: TeacherInfo
    target_layer_ids: tuple[int, ...]
    tokenizer_hash: str
    max_length: int
    codec: str = "bf16-zstd"
    bucket_edges: tuple[int, ...] = (256, 512, 1024, 2048)
    dataset_fingerprint: str = ""
    format_version: int = field(default=FORMAT_VERSION)
    # The drafter's block-filler token (an id of the teacher vocab), resolved at extraction so that
    # training and export read it from here. None only in caches written before it was recorded;
    # None fields are left out of to_dict(), so those caches keep their fingerprint.
    mask_token_id: int | None = None
    mask_token_source: str | None = None  # one of MASK_TOKEN_SOURCES
    # Every other setting that changes what a part holds, by its dotted config name
    # (``extract.unit_size``, ``data.min_loss_tokens`` ...): two jobs that differ in one of them would
    # write different bytes for the same sample, so they cannot share a cache. None (caches written
    # before these were recorded) is left out of to_dict(), so those caches keep their fingerprint.
    content_settings: dict[str, Any] | None = None
    # The teacher's final normed hidden state (HF ``hidden_states[-1]``, what its lm_head reads) stored per
    # token as one more H-wide slot of ``features`` after the layers, with the same codec; the distribution
    # losses (KL, TV, LK) need it. False is left out of to_dict(): caches without it keep their fingerprint.
    final_hidden: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "bucket_edges", tuple(int(e) for e in self.bucket_edges))
        if self.content_settings is not None:
            object.__setattr__(self, "content_settings", dict(sorted(self.content_settings.items())))
        self._validate()

    def _validate(self) -> None:
        if self.codec not in CODECS:
            raise ConfigError(f"cache codec {self.codec!r} is not one of {list(CODECS)}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty: the cache needs at least one teacher layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.teacher.num_layers]
        if bad:
            raise ConfigError(
                f"target_layer_ids {bad} are outside the teacher's layers 0..{self.teacher.num_layers - 1}"
            )
        edges = list(self.bucket_edges)
        if sorted(set(edges)) != edges or any(e <= 0 for e in edges):
            raise ConfigError(f"bucket_edges must be strictly increasing positive lengths, got {edges}")
        if self.max_length <= 0:
            raise ConfigError(f"max_length must be positive, got {self.max_length}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.teacher.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the teacher vocabulary "
                              f"[0, {self.teacher.vocab_size})")
        if self.mask_token_source is not None and self.mask_token_source not in MASK_TOKEN_SOURCES:
            raise ConfigError(f"mask_token_source {self.mask_token_source!r} is not one of {list(MASK_TOKEN_SOURCES)}")

    @property
    def n_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.teacher.hidden_size

    @property
    def feature_slots(self) -> int:
        """H-wide slots per stored token: the layers, plus the final normed state when it is stored."""
        return self.n_layers + int(self.final_hidden)

    @property
    def layer_feature_dim(self) -> int:
        """Width of the drafter's input features: ``len(target_layer_ids) * hidden_size``."""
        return self.n_layers * self.teacher.hidden_size

    @property
    def feature_dim(self) -> int:
        """Width of the stored features: ``feature_slots * hidden_size`` (the layers, then the final state)."""
        return self.feature_slots * self.teacher.hidden_size

    @property
    def n_buckets(self) -> int:
        return len(self.bucket_edges) + 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["bucket_edges"] = list(self.bucket_edges)
        for key in ("mask_token_id", "mask_token_source", "content_settings"):
            if d[key] is None:
                del d[key]
        if not d["final_hidden"]:
            del d["final_hidden"]
        return d

    @property
    def fingerprint(self) -> str:
        """sha256 (first 16 hex digits) of the canonical JSON of every field but the provenance ones."""
        d = {k: v for k, v in self.to_dict().items() if k not in _PROVENANCE}
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def diff(self, other: CacheSpec) -> list[str]:
        """Dotted names of the fields that differ (``teacher.hidden_size``, ``codec`` ...)."""
        return _diff_dicts(self.to_dict(), other.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheSpec:
        try:
            d = dict(d)
            teacher = TeacherInfo(**d.pop("teacher"))
            return cls(teacher=teacher, **d)
        except (TypeError, KeyError) as err:
            raise CacheError(f"the cache spec in the root attributes is malformed ({err}); "
                             "the cache was written by an incompatible tool") from None


def _diff_dicts(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff_dicts(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(f"{prefix}{key}")
    return out


def describe_diff(cached: CacheSpec, wanted: CacheSpec) -> str:
    """One line per differing field: ``codec: cache has 'bf16-zstd', asked for 'fp8-e4m3'``."""
    a, b = _flatten(cached.to_dict()), _flatten(wanted.to_dict())
    return "; ".join(f"{k}: cache has {a.get(k)!r}, asked for {b.get(k)!r}" for k in cached.diff(wanted))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def root_attrs(storage: Storage) -> dict[str, Any] | None:
    """The cache's root attributes (``zarr.json``); None when there is no root document."""
    try:
        raw = storage.get("zarr.json")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        raise NotACacheError(f"{storage.url}/zarr.json is not valid JSON: this is not a dflash cache") from None
    attrs = (meta.get("attributes") or {}).get(ATTR_KEY) if isinstance(meta, dict) else None
    if not isinstance(attrs, dict):
        raise NotACacheError(f"{storage.url} is a zarr store but not a dflash cache (no '{ATTR_KEY}' root "
                             "attribute); point at a cache made by dflash-extract")
    return attrs

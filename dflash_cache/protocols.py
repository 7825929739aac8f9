"""The cache as the stages use it: the interfaces that cross from ``dflash_cache`` into ``extract`` and ``train``.

Extraction writes through a :class:`WritableCache` and the :class:`PartSink` each of its part writers is;
training and evaluation read through a :class:`ReadableCache`. :class:`~dflash_cache.store.FeatureCache` and
:class:`~dflash_cache.writer.PartWriter` implement them (``tests/test_cache_protocols.py`` checks every member,
name and parameters, against them), so a stage that types a parameter with one of these names states what it
uses of the cache rather than taking the whole store, and a stand-in for tests needs only these members.

Annotations only: importing this module loads no torch, numpy or zarr.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .errors import CacheCorruptError
    from .index import CacheIndex
    from .lease import PartLease
    from .parts import PartInfo
    from .reader import Sample
    from .spec import CacheSpec
    from .storage import Storage


@runtime_checkable
class CacheView(Protocol):
    """What both stages see of an opened cache: its spec, where it is, its committed parts and metadata."""

    spec: CacheSpec

    @property
    def url(self) -> str: ...

    def parts(self) -> list[PartInfo]:
        """Committed parts only, ordered by (bucket, name)."""
        ...

    def read_metadata(self, name: str) -> Any: ...


@runtime_checkable
class ReadableCache(CacheView, Protocol):
    """The cache training, evaluation and export read: the index, samples, token ids and the teacher head."""

    storage: Storage  # the byte store, for the loader's decode threads and read-ahead

    def bucket_of(self, length: int) -> int: ...

    def scan_parts(self) -> tuple[list[PartInfo], list[CacheCorruptError]]:
        """Committed parts, and the parts whose commit record cannot be read (instead of raising)."""
        ...

    def index(self, skip_corrupt: bool = False) -> CacheIndex: ...

    def read_samples(self, sample_ids: Sequence[int]) -> list[Sample]: ...

    def read_token_ids(self, sample_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]: ...

    def read_rows(self, part: PartInfo, rows: Sequence[int], out: Sequence[torch.Tensor] | None = None
                  ) -> list[Sample]: ...

    def load_head(self) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class PartSink(Protocol):
    """One part being written by one writer: samples added, then committed (or aborted)."""

    def add(self, sample_id: int, input_ids: Any, loss_mask: Any, features: torch.Tensor,
            target_argmax: Any = None) -> None: ...

    def commit(self) -> PartInfo: ...

    def abort(self) -> None: ...


@runtime_checkable
class WritableCache(CacheView, Protocol):
    """The cache extraction writes: parts (each under its lease), metadata documents and the teacher head."""

    storage: Storage  # the byte store: part leases, the extraction's plan and state records

    def reopen_lost_parts(self, timeout_s: float = 600.0) -> list[str]:
        """Make committed parts whose record names a generation with no file left uncommitted again."""
        ...

    def part_writer(self, bucket: int, name: str, meta: dict[str, Any] | None = None,
                    lease: PartLease | None = None) -> PartSink: ...

    def write_metadata(self, name: str, obj: Any) -> None: ...

    def save_head(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None) -> None: ...

    def has_head(self) -> bool: ...

    def head_record(self) -> dict[str, int] | None: ...

"""dflash_cache: the on-disk feature cache shared by extraction and training (a zarr v3 group).

See docs/architecture.md ("The cache") for the contract.

The names below are imported on first use, so that the command lines (``dflash_cache.runtime``) check
their arguments and config before torch is loaded: a typo costs milliseconds, not seconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CacheIndex": ".index", "PartInfo": ".parts", "Sample": ".reader", "CODECS": ".spec", "FORMAT_VERSION": ".spec",
    "CacheSpec": ".spec", "TeacherInfo": ".spec", "FeatureCache": ".store", "create_cache": ".store",
    "open_cache": ".store", "VerifyReport": ".verify", "verify_cache": ".verify", "PartWriter": ".writer",
}
__all__ = [
    "CODECS", "FORMAT_VERSION", "CacheIndex", "CacheSpec", "FeatureCache", "PartInfo", "PartWriter", "Sample",
    "TeacherInfo", "VerifyReport", "create_cache", "open_cache", "verify_cache",
]

if TYPE_CHECKING:
    from .index import CacheIndex
    from .parts import PartInfo
    from .reader import Sample
    from .spec import CODECS, FORMAT_VERSION, CacheSpec, TeacherInfo
    from .store import FeatureCache, create_cache, open_cache
    from .verify import VerifyReport, verify_cache
    from .writer import PartWriter


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value

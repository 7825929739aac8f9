"""dflash_cache: the on-disk feature cache shared by extraction and training (a zarr v3 group).

See docs/architecture.md ("The cache") for the contract.
"""

from .index import CacheIndex
from .parts import PartInfo
from .reader import Sample
from .spec import CODECS, FORMAT_VERSION, CacheSpec, TeacherInfo
from .store import FeatureCache, create_cache, open_cache
from .writer import PartWriter

__all__ = [
    "CODECS", "FORMAT_VERSION", "CacheIndex", "CacheSpec", "FeatureCache", "PartInfo", "PartWriter", "Sample",
    "TeacherInfo", "create_cache", "open_cache", "verify_cache",
]


def verify_cache(url: str, **kwargs):  # noqa: ANN201 - re-exported lazily to keep imports light
    from .verify import verify_cache as _verify

    return _verify(url, **kwargs)

"""dflash_cache: the on-disk feature cache shared by extraction and training (a zarr v3 group).

See docs/architecture.md ("The cache") for the contract.
"""

from .index import CacheIndex
from .parts import PartInfo
from .reader import Sample
from .spec import CODECS, FORMAT_VERSION, CacheSpec, TeacherInfo
from .store import FeatureCache, create_cache, open_cache
from .verify import VerifyReport, verify_cache
from .writer import PartWriter

__all__ = [
    "CODECS", "FORMAT_VERSION", "CacheIndex", "CacheSpec", "FeatureCache", "PartInfo", "PartWriter", "Sample",
    "TeacherInfo", "VerifyReport", "create_cache", "open_cache", "verify_cache",
]


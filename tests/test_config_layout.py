"""Each stage owns its config sections, and one module composes them.

The composer (``dflash_cache/runtime/schema.py``) is the one module of ``dflash_cache`` that imports from the
stages (tests/test_import_rules.py); that exception is only safe while the stages' config modules are
pydantic-only, which the tests below hold: loading the schema loads no torch and no stage code.
"""

from __future__ import annotations

import subprocess
import sys

from dflash_cache.runtime.reference import source_file
from dflash_cache.runtime.schema import PipelineConfig

OWNERS = {
    "teacher": "extract/config.py", "data": "extract/config.py", "regenerate": "extract/config.py",
    "extract": "extract/config.py", "cache": "dflash_cache/config.py", "model": "train/config.py",
    "train": "train/config.py", "loader": "train/config.py", "checkpoint": "train/config.py",
    "guards": "train/config.py", "eval": "train/config.py", "metrics": "train/config.py",
}


def test_every_section_is_declared_by_the_stage_that_owns_it():
    declared = {name: source_file(field.annotation) for name, field in PipelineConfig.model_fields.items()}
    assert declared == OWNERS


def test_loading_the_schema_loads_no_torch_and_no_stage_code():
    code = ("import sys; from dflash_cache.runtime.config import load_config; import dflash_cache.runtime.schema\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'train', 'extract')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['extract', 'extract.config', 'train', 'train.config']"

"""Each stage owns its config sections, and one module composes them.

The composer (``dflash_cache/runtime/schema.py``) is the one module of ``dflash_cache`` that imports from the
stages (tests/test_import_rules.py); that exception is only safe while the stages' config modules are
pydantic-only, which the tests below hold: loading the schema loads no torch and no stage code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_cache.runtime.config import load_config
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


# -- no component reads another stage's section ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"extract": {"teacher", "data", "regenerate", "extract"},
            "train": {"model", "train", "loader", "checkpoint", "guards", "eval", "metrics"}}
# (file name, foreign section) -> why that read is deliberate. Keyed by file name, not path, so that moving a
# module between a stage's folders keeps its entry. The cache section is read by both stages (extraction
# writes the cache that training reads), so it is foreign to neither.
EXCEPTIONS = {
    ("demo.py", "teacher"): "the demo chains every stage: it extracts a cache with the teacher and evaluates "
                            "the drafter against that same teacher",
    ("evaluate.py", "teacher"): "live speculative decoding runs the teacher (the import exception of "
                                "test_import_rules: train.tools.evaluate uses extract.teacher)",
    ("estimate.py", "teacher"): "the training memory estimate needs the teacher's shapes; teacher.hidden_size, "
                                "vocab_size and num_layers exist for it when no cache or weights are at hand",
    ("estimate.py", "data"): "without a cache, data.max_length is the longest sample the run would see",
}


def _foreign_reads(stage: str) -> set[tuple[str, str, int]]:
    """``(file name, section, line)`` of each ``cfg.<section>`` in ``stage`` for a section another stage owns;
    ``cfg`` is any name a function there annotates as ``PipelineConfig`` (and the conventional ``cfg``)."""
    foreign = set().union(*(s for k, s in SECTIONS.items() if k != stage))
    out = set()
    for path in sorted((ROOT / stage).rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {"cfg"} | {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)
                           and node.annotation is not None and "PipelineConfig" in ast.unparse(node.annotation)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in foreign and isinstance(node.value, ast.Name)
                    and node.value.id in names):
                out.add((path.name, node.attr, node.lineno))
    return out


def test_the_scan_finds_a_foreign_read(tmp_path, monkeypatch):
    stage = tmp_path / "extract"
    stage.mkdir()
    (stage / "run.py").write_text("def f(c: 'PipelineConfig'):\n    return c.model.block_size, c.cache.codec\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _foreign_reads("extract") == {("run.py", "model", 2)}


@pytest.mark.parametrize("stage", sorted(SECTIONS))
def test_no_component_reads_another_stages_section(stage):
    reads = _foreign_reads(stage)
    unexplained = sorted(r for r in reads if (r[0], r[1]) not in EXCEPTIONS)
    assert not unexplained, (f"{stage}/ reads sections another stage owns: {unexplained}; give the setting to "
                             "the stage that uses it, or resolve it in dflash_cache/runtime/schema.py")


def test_every_listed_exception_is_still_needed():
    reads = {(name, section) for stage in SECTIONS for name, section, _ in _foreign_reads(stage)}
    assert set(EXCEPTIONS) <= reads, f"stale exceptions: {sorted(set(EXCEPTIONS) - reads)}"


def test_values_handed_across_stages(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    cfg = load_config(empty, ["model.block_size=8", "loader.num_readers=3"])
    assert (cfg.min_loss_tokens, cfg.mask_token_id, cfg.cpu_worker_threads) == (16, None, 3)
    cfg = load_config(empty, ["data.min_loss_tokens=5", "model.mask_token_id=7"])
    assert (cfg.min_loss_tokens, cfg.mask_token_id) == (5, 7)

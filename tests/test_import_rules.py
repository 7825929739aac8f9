"""The package boundaries of DESIGN.md: ``dflash_cache`` imports neither stage, ``extract`` never imports
``train``, and ``train`` imports from ``extract`` only the teacher capture (live evaluation, with the teacher's
config section) and, in the demo that chains every stage, the extract command. The one exception below
``dflash_cache``: the config composer imports each stage's (torch-free) config module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {("train/evaluate.py", "extract.teacher"), ("train/evaluate.py", "extract.config"),
           ("train/demo.py", "extract.cli")}
COMPOSER = {("dflash_cache/runtime/schema.py", "extract.config"), ("dflash_cache/runtime/schema.py", "train.config")}


def _imports(package: str) -> set[tuple[str, str]]:
    out = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            out |= {(str(path.relative_to(ROOT)), n) for n in names}
    return out


def test_package_boundaries():
    def crossing(package: str, others: tuple[str, ...]) -> set[tuple[str, str]]:
        return {(f, m) for f, m in _imports(package) if m.split(".")[0] in others}

    assert crossing("dflash_cache", ("extract", "train")) == COMPOSER
    assert crossing("extract", ("train",)) == set()
    assert crossing("train", ("extract",)) <= ALLOWED

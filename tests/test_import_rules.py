"""The package boundaries of DESIGN.md: ``dflash_cache`` imports neither stage, ``extract`` never imports
``train``, and ``train`` imports from ``extract`` only the teacher capture (live evaluation, with the teacher's
config section) and, in the demo that chains every stage, the extract command. The one exception below
``dflash_cache``: the config composer imports each stage's (torch-free) config module. Inside ``train/`` the
folders are layered: the data path and the models import no other folder, the components neither the loop nor
the tools, the tools not the loop.

These rules are the source of docs/architecture.md's layer tables (tests/test_architecture_doc.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages it never imports
BOUNDARIES: dict[str, tuple[str, ...]] = {"dflash_cache": ("extract", "train"), "extract": ("train",),
                                          "train": ("extract",)}
# (file, module) crossings allowed despite BOUNDARIES, and why
ALLOWED: dict[tuple[str, str], str] = {
    ("train/tools/evaluate.py", "extract.teacher"): "live evaluation captures the teacher's features with the "
                                                    "extraction code",
    ("train/tools/evaluate.py", "extract.config"): "live evaluation runs the teacher from its own config section",
    ("train/demo.py", "extract.cli"): "the demo chains every stage",
    ("dflash_cache/runtime/schema.py", "extract.config"): "the one composer of every stage's config sections",
    ("dflash_cache/runtime/schema.py", "train.config"): "the one composer of every stage's config sections",
}
COMPOSER = {k for k in ALLOWED if k[0] == "dflash_cache/runtime/schema.py"}
# folder of train/ -> the folders of train/ it never imports
TRAIN_LAYERS: dict[str, tuple[str, ...]] = {
    "data": ("models", "components", "loop", "tools"),
    "models": ("data", "components", "loop", "tools"),
    "components": ("loop", "tools"),
    "tools": ("loop",),
    "loop": (),
}


def _imports(package: str) -> set[tuple[str, str]]:
    """(file, absolute module) of every import under ``package`` (relative imports resolved)."""
    out = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT)
        here = list(rel.parent.parts)  # the package a relative import starts from
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - (node.level - 1)]
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                continue
            out |= {(str(rel), n) for n in names}
    return out


def test_package_boundaries():
    def crossing(package: str, others: tuple[str, ...]) -> set[tuple[str, str]]:
        return {(f, m) for f, m in _imports(package) if m.split(".")[0] in others}

    assert crossing("dflash_cache", ("extract", "train")) == COMPOSER
    assert crossing("extract", ("train",)) == set()
    assert crossing("train", ("extract",)) <= set(ALLOWED)
    for package, never in BOUNDARIES.items():
        assert crossing(package, never) <= set(ALLOWED), package


def test_train_folders_are_layered():
    folders = {p.name for p in (ROOT / "train").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(TRAIN_LAYERS), "every folder of train/ has a layer rule"
    broken = []
    for f, m in _imports("train"):
        parts = Path(f).parts
        if len(parts) < 3 or not m.startswith("train."):
            continue
        target = m.split(".")[1]
        if target in TRAIN_LAYERS.get(parts[1], ()):
            broken.append(f"{f} imports {m}")
    assert broken == []


def test_the_import_scan_sees_relative_imports():
    found = _imports("train")
    assert ("train/loop/loop.py", "train.components.checkpoint") in found
    assert ("train/models/distill.py", "train.models.objective") in found


def _module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, every import counted (inside functions and
    under ``TYPE_CHECKING`` too: a deferred import is still a circle), ``from . import x`` resolved to the
    module ``x`` where there is one."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*here[: len(here) - (node.level - 1)], *([node.module] if node.module else [])]) \
                    if node.level else node.module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                # a module importing its own parent package is how packages re-export: not counted
                if name and name != mod and not mod.startswith(name + "."):
                    deps.add(name)
        graph[mod] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_inside_a_package():
    for package in BOUNDARIES:
        assert _circles(_module_graph(package)) == [], package


def test_the_circle_check_finds_a_circle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert _circles(graph) == [["p.a", "p.b", "p.c"]]
    cache = _module_graph("dflash_cache")
    assert "dflash_cache.locks" in cache["dflash_cache.lease"]  # `from . import locks` resolved to the module

"""The extract package's module graph: the command, the loop and the pieces other subcommands share are separate
modules, and no two modules import each other, directly or round a longer cycle (imports inside functions
count: a cycle there still ties the modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_graph(package: str) -> dict[str, set[str]]:
    """``module -> modules of the same package it imports`` (top level and inside functions)."""
    pkg = ROOT / package
    names = {p.stem for p in pkg.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {n: set() for n in names}
    for name in names:
        for node in ast.walk(ast.parse((pkg / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    targets = [node.module] if node.module else [a.name for a in node.names]
                elif node.level == 0 and node.module and node.module.split(".")[0] == package:
                    targets = [node.module.split(".", 1)[1]] if "." in node.module else [a.name for a in node.names]
                else:
                    continue
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith(package + ".")]
            else:
                continue
            graph[name] |= {t.split(".")[0] for t in targets if t and t.split(".")[0] in names}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first search, each as the modules round it."""
    found, seen = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycle = path[path.index(nxt):]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append([*cycle, nxt])
            else:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def test_the_cycle_search_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_extract_modules():
    assert cycles(module_graph("extract")) == []


def test_the_command_the_loop_and_the_shared_pieces_are_apart():
    graph = module_graph("extract")
    # what estimate, regenerate and endpoint take from extraction is the shared config reading, not the
    # extraction command or its loop
    for user in ("estimate", "regenerate", "endpoint"):
        assert not graph[user] & {"run", "loop", "output"}, (user, graph[user])
    # the two regeneration back ends share the turn handling, and the server one never reaches into the other
    assert "regenerate" not in graph["endpoint"] and "turns" in graph["endpoint"] & graph["regenerate"]
    assert graph["run"] >= {"loop", "cli_args"} and "run" not in set().union(*graph.values())

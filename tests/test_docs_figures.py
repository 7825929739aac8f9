"""Every measured figure of the recipe evidence comes from a file under bench/results.

docs/recipe.md and the README's recipe lines are read section by section (a section is a heading and the text
under it, down to the next heading of the same or a higher level). A section's sources are the
``bench/results/*.json`` files it names, or any enclosing section names. In each section:

* a ``median [min, max]`` triple (``6.51 [6.43, 6.64]``, ``+0.76 [+0.55, +0.95]``) must be one summary in a
  source: an object with ``median``, ``min`` and ``max`` whose three values round to the triple, all three at once;
* every other decimal figure must be a number in a source, rounded as the text rounds it;
* a duration (``41 min``, ``35 min 14 s``, ``62-64 s``) must be a number of seconds (or minutes) in a source,
  rounded to the text's unit.

A figure that is a setting, not a measurement, is skipped only where the text says so: in code (commands,
config keys), or after a setting's name (``top-p 0.95``, ``T = 1``, ``lr 3e-3``) or a goal sign (``≤ 1.5``).
Figures in a section that names no source fail: the fix is to name the results file, or to re-measure or
remove the figure. The reference values are read straight from the JSON files; nothing of the product is
imported.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

NUM = r"[+\-−]?\d+(?:,\d{3})*(?:\.\d+)?"
TRIPLE = re.compile(rf"(?<![\w.])({NUM}) \[({NUM}), ({NUM})\]")
DECIMAL = re.compile(r"(?<![\w.\-/+−])([+\-−]?\d+\.\d+)( ?M\b)?(?!\.?\d|\w|-\d)")
DURATION = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})*(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))? (min|s)\b(?: (\d+) s\b)?")
SOURCE = re.compile(r"bench/results/([\w.\-]+\.json)")
HEADING = re.compile(r"^(#{1,6}) ")
# a figure right after one of these is a setting or a goal, not a measurement
SETTING_BEFORE = re.compile(
    r"(?:top-p|top-k|T =|T=|lr|Muon|AdamW|γ =|γ|alpha|α|≤|≥|<|>|goal(?: of)?|version|v|Qwen|hidden|block|"
    r"rank|layers?|window|×|x|\^|e-|temperature|threshold|=|e\.g\.|momentum|decay|seed)\s*$", re.IGNORECASE)
# ... or right before the name of what it weighs (``0.5 CE + 0.5 TV``)
SETTING_AFTER = re.compile(r"^\s*(?:CE|TV|KL|LK|x|×)\b")


@dataclass
class Section:
    title: str
    level: int
    lines: list[str] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)


def _plain(text: str) -> str:
    """The prose of a markdown text: fenced blocks and inline code removed (commands and keys are settings)."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"(\d\.\d+)-(?=\d)", r"\1 - ", text)  # a range of decimals: both ends are figures
    return text.replace("**", "")  # bold marks a figure, it does not split one


def sections(text: str, doc: str) -> list[Section]:
    """The document's sections, each with the sources it and its enclosing sections name."""
    out: list[Section] = []
    stack: list[Section] = []
    current = Section(doc, 0)
    in_fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else HEADING.match(line)
        if m:
            out.append(current)
            level = len(m.group(1))
            stack = [s for s in stack if s.level < level]
            current = Section(f"{doc}: {line.strip()}", level)
            stack.append(current)
            current.sources |= {src for s in stack[:-1] for src in s.sources}
            continue
        current.lines.append(line)
        current.sources |= set(SOURCE.findall(line))
    out.append(current)
    return out


def _value(token: str) -> float:
    return float(token.replace("−", "-").replace(",", ""))


def _decimals(token: str) -> int:
    return len(token.split(".")[1]) if "." in token else 0


def _numbers(node: object) -> list[float]:
    if isinstance(node, bool):
        return []
    if isinstance(node, (int, float)):
        return [float(node)] if math.isfinite(node) else []
    if isinstance(node, dict):
        return [x for v in node.values() for x in _numbers(v)]
    if isinstance(node, list):
        return [x for v in node for x in _numbers(v)]
    return []


def _summaries(node: object) -> list[tuple[float, float, float]]:
    found: list[tuple[float, float, float]] = []
    if isinstance(node, dict):
        if all(isinstance(node.get(k), (int, float)) for k in ("median", "min", "max")):
            found.append((float(node["median"]), float(node["min"]), float(node["max"])))
        for v in node.values():
            found += _summaries(v)
    elif isinstance(node, list):
        for v in node:
            found += _summaries(v)
    return found


def _load(name: str) -> object:
    path = RESULTS / name
    assert path.is_file(), f"the docs name {path.relative_to(ROOT)}, which does not exist"
    return json.loads(path.read_text())


def _rounds_to(value: float, token: str, scale: float = 1.0) -> bool:
    want, d = _value(token), _decimals(token)
    if token[0] not in "+-−":  # an unsigned figure may be a magnitude ("a cost of 0.7")
        value = abs(value)
    return abs(value / scale - want) <= 0.5 * 10 ** -d + 1e-6


def _is_setting(prose: str, start: int, end: int) -> bool:
    return bool(SETTING_BEFORE.search(prose[max(0, start - 24):start]) or SETTING_AFTER.match(prose[end:end + 8]))


def unsourced(section: Section) -> list[str]:
    """The figures of ``section`` that no source of it holds, each with its line."""
    prose = _plain("\n".join(section.lines))
    problems: list[str] = []
    data = [_load(s) for s in sorted(section.sources)]
    numbers = [x for d in data for x in _numbers(d)]
    summaries = [t for d in data for t in _summaries(d)]

    def where(start: int) -> str:
        line = prose[:start].count("\n")
        return f"{section.title} (line {line + 1} of the section): {prose.splitlines()[line].strip()[:120]}"

    covered: list[tuple[int, int]] = []
    for m in TRIPLE.finditer(prose):
        covered.append(m.span())
        if _is_setting(prose, m.start(), m.end()):
            continue
        med, lo, hi = m.groups()
        if not any(_rounds_to(a, med) and _rounds_to(b, lo) and _rounds_to(c, hi) for a, b, c in summaries):
            problems.append(f"{med} [{lo}, {hi}]: no median/min/max summary in {sorted(section.sources)} — {where(m.start())}")
    for m in DURATION.finditer(prose):
        covered.append(m.span())
        if _is_setting(prose, m.start(), m.end()):
            continue
        first, second, unit, extra_s = m.groups()
        if extra_s is not None:  # "35 min 14 s": the seconds of the whole
            want = _value(first) * 60 + float(extra_s)
            ok = any(abs(x - want) <= 0.5 + 1e-9 for x in numbers)
            label = f"{first} min {extra_s} s"
        else:
            scales = (60.0, 1.0) if unit == "min" else (1.0, 1e-3)  # minutes: seconds or minutes; s: s or ms
            ends = [t for t in (first, second) if t is not None]
            ok = all(any(_rounds_to(x, t, scale) for x in numbers for scale in scales) for t in ends)
            label = f"{first}{'-' + second if second else ''} {unit}"
        if not ok:
            problems.append(f"{label}: no such duration in {sorted(section.sources)} — {where(m.start())}")
    for m in DECIMAL.finditer(prose):
        if any(a <= m.start() < b for a, b in covered) or _is_setting(prose, m.start(), m.end()):
            continue
        token, millions = m.group(1), m.group(2)
        scales = (1e6,) if millions else (1.0, 0.01)  # "14.7 M": millions; else the number, or a share as a percentage
        if not any(_rounds_to(x, token, scale) for x in numbers for scale in scales):
            problems.append(f"{token}: no such number in {sorted(section.sources)} — {where(m.start())}")
    return problems


def _readme_recipe_lines() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Real conversations: which recipe to train")
    end = text.index("\n## ", start + 3)
    return text[start:end]


DOCS = {
    "docs/recipe.md": lambda: (ROOT / "docs" / "recipe.md").read_text(),
    "README.md (recipe lines)": _readme_recipe_lines,
}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_recipe_figure_has_a_results_file(doc: str) -> None:
    problems = [p for s in sections(DOCS[doc](), doc) for p in unsourced(s)]
    assert not problems, f"{len(problems)} figure(s) in {doc} with no source under bench/results:\n" + "\n".join(problems)


# -- the checker itself: it must fail on figures it cannot find ----------------------------------------------------


def _fake_results(tmp_path: Path) -> None:
    (tmp_path / "fake.json").write_text(json.dumps({"total_s": 2463.5, "tau": {"median": 6.5123, "min": 6.43, "max": 6.6449},
                                                    "per_run_s": [62.4, 63.9], "share": 0.427}))


@pytest.fixture
def fake_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_results(tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "RESULTS", tmp_path)


def _check(text: str) -> list[str]:
    return [p for s in sections(text, "doc") for p in unsourced(s)]


def test_checker_accepts_figures_that_are_in_the_named_file(fake_results: None) -> None:
    text = ("## Evidence\n\nFrom `bench/results/fake.json`: τ 6.51 [6.43, 6.64], 41 min in all, 62-64 s per run, "
            "42.7% of the prompts, at top-p 0.95 and T = 1.3, goal ≤ 1.5.\n\n### Below\n\nstill 6.51.\n")
    assert _check(text) == []


@pytest.mark.parametrize("figure", ["6.52 [6.43, 6.64]", "6.51 [6.43, 6.65]", "23 min", "62-66 s", "5.22", "43.0%"])
def test_checker_names_a_figure_that_is_not_in_the_file(fake_results: None, figure: str) -> None:
    problems = _check(f"## Evidence\n\nFrom `bench/results/fake.json`: the figure {figure} here.\n")
    assert len(problems) == 1 and figure.split(" [")[0].rstrip("%").split("-")[0] in problems[0], problems


def test_checker_refuses_figures_in_a_section_with_no_source(fake_results: None) -> None:
    text = "## One\n\nFrom `bench/results/fake.json`: 6.51.\n\n## Two\n\nAnother run gave 6.51.\n"
    problems = _check(text)
    assert len(problems) == 1 and "## Two" in problems[0]

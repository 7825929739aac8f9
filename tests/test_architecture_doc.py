"""docs/architecture.md checked against the code, the way docs/config.md is: its layer tables are generated
from the rules tests/test_import_rules.py enforces, every ``train.…`` name it mentions exists (a module, an
attribute of one, or a config field), every metric tag it names is a tag the code writes and docs/metrics.md
lists, and its fault-injection line names the switch and the fields the code reads.

    .venv/bin/python tests/test_architecture_doc.py    # rewrite the generated tables
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_import_rules import ALLOWED, BOUNDARIES, TRAIN_LAYERS  # noqa: E402

DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- layers:begin -->", "<!-- layers:end -->"
TAG = re.compile(r"(?<![\w/.])((?:train|eval|perf|acc|loss|ckpt|selector)/[\w<>]+)(?![\w/.<>])")


def _doc_line(text: str | None) -> str:
    return " ".join((text or "").split())


def layer_tables() -> str:
    """The generated block: package boundaries, then train/'s folders (what each holds and never imports)."""
    lines = ["| package | never imports | except |", "|---|---|---|"]
    for package, never in BOUNDARIES.items():
        allowed = "; ".join(f"`{f}` imports `{m}`: {why}" for (f, m), why in ALLOWED.items()
                            if f.split("/")[0] == package)
        lines.append(f"| `{package}` | {', '.join(f'`{n}`' for n in never)} | {allowed} |")
    lines += ["", "| `train/` folder | modules | holds | never imports |", "|---|---|---|---|"]
    train = ROOT / "train"
    for folder, never in TRAIN_LAYERS.items():
        mods = sorted(p.stem for p in (train / folder).glob("*.py") if p.stem != "__init__")
        doc = _doc_line(ast.get_docstring(ast.parse((train / folder / "__init__.py").read_text())))
        lines.append(f"| `{folder}/` | {', '.join(f'`{m}`' for m in mods)} | {doc} | "
                     f"{', '.join(f'`{n}/`' for n in never) or '(may import every folder)'} |")
    top = sorted(p.stem for p in train.glob("*.py") if p.stem != "__init__")
    holds = "; ".join(f"`{m}`: {_doc_line(ast.get_docstring(ast.parse((train / f'{m}.py').read_text()))).split('. ')[0]}"
                      for m in top)
    lines.append(f"| (top) | {', '.join(f'`{m}`' for m in top)} | {holds} | |")
    return "\n".join(lines) + "\n"


def _with_tables(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{layer_tables()}{END}{tail}"


def test_the_layer_tables_are_generated_from_the_import_rules():
    text = DOC.read_text()
    assert BEGIN in text and END in text
    assert text == _with_tables(text), ("docs/architecture.md's layer tables differ from tests/test_import_rules.py; "
                                        "run .venv/bin/python tests/test_architecture_doc.py")


def _resolves(name: str) -> bool:
    """``train.a.b.c``: a module, an attribute path of one, or a field of the train config section."""
    from train.config import TrainConfig

    parts = name.split(".")
    if parts[1] in TrainConfig.model_fields:
        return len(parts) == 2
    for n in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError:
            continue
        for attr in parts[n:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_train_name_the_page_mentions_exists():
    names = set(re.findall(r"(?<![\w./-])train\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", DOC.read_text()))
    assert len(names) >= 20
    missing = sorted(n for n in names if not _resolves(n))
    assert missing == [], f"docs/architecture.md names what the code no longer has: {missing}"


def _code_tag_patterns() -> list[re.Pattern[str]]:
    """Every string constant and f-string of train/ as a pattern (a replacement field matches anything)."""
    out = []
    for path in (ROOT / "train").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                out.append("".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value:
                out.append(re.escape(node.value))
    return [re.compile(p) for p in out]


def _metrics_page_tags() -> list[re.Pattern[str]]:
    out = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| (`[^|]+`) \| (train|eval|save|commit)", line)
        if m:
            out += [re.compile(re.escape(t).replace(re.escape("<b>"), r"\d+").replace(re.escape("<k>"), r"\d+"))
                    for t in re.findall(r"`([^`]+)`", m.group(1))]
    return out


def test_every_metric_tag_the_page_names_is_written_by_the_code_and_listed_in_metrics_md():
    tags = sorted(set(TAG.findall(DOC.read_text())))
    assert len(tags) >= 10, tags
    code, listed = _code_tag_patterns(), _metrics_page_tags()
    concrete = {t: t.replace("<k>", "1").replace("<b>", "1") for t in tags}
    assert [t for t, c in concrete.items() if not any(p.fullmatch(c) for p in listed)] == [], \
        "named in docs/architecture.md but not listed in docs/metrics.md"
    assert [t for t, c in concrete.items() if not any(p.fullmatch(c) for p in code)] == [], \
        "named in docs/architecture.md but written nowhere in train/"


def test_the_fault_injection_line_names_the_switch_and_the_fields_the_code_reads():
    from train.loop.step import FAULTS_ENV, FaultPlan

    m = re.search(r"(\w+)='(\{[^']*\})'", DOC.read_text())
    assert m is not None, "docs/architecture.md names no fault-injection switch"
    assert m.group(1) == FAULTS_ENV
    assert set(json.loads(m.group(2))) == {f.name for f in dataclasses.fields(FaultPlan)}


if __name__ == "__main__":
    DOC.write_text(_with_tables(DOC.read_text()))
    print(f"wrote the layer tables of {DOC}")

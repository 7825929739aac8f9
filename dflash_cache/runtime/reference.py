"""The config reference page, ``docs/config.md``, generated from the schema.

The page walks the composed schema (:class:`dflash_cache.runtime.schema.PipelineConfig`) section by
section; every field's description is its docstring in the module of the stage that owns the section
(``train/config.py``, ``extract/config.py``, ``dflash_cache/config.py``); its type, bounds and default come
from the schema itself, so the page cannot drift from what the commands accept. Defaults
are written as TOML values, the form ``--set key=value`` and the presets take.

``python -m dflash_cache.runtime.reference`` (``make docs``) rewrites the page; ``--check`` exits 1 when
it is out of date. ``tests/test_config_reference.py`` fails when the page and the schema disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic.fields import FieldInfo

from .schema import SECTION_READERS, PipelineConfig
from .section import Section
from .switches import SWITCHES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"

INTRO = """\
# Config reference

<!-- Generated from the schema by `make docs` (python -m dflash_cache.runtime.reference).
     Edit the field docstrings in each section's module (named under its heading), not this page:
     tests/test_config_reference.py fails when they differ. -->

One schema for every command (`dflash_cache/runtime/schema.py`), composed from the sections each stage
declares: `extract/config.py`, `dflash_cache/config.py` and `train/config.py`. A preset (`configs/*.toml`) is a TOML
file with the sections below; every key is optional and takes the default shown. Unknown keys are
errors, and every problem is reported at once with its dotted path. `--set KEY=VALUE` (repeatable)
overrides one key with a TOML value and is validated the same way:

```bash
dflash-train configs/tiny.toml --cache CACHE --run-dir RUN --set train.lr=3e-4 --set train.betas=[0.9,0.99]
dflash-extract configs/tiny.toml --out CACHE --set cache.bucket_edges=[128,320] --set teacher.path=/models/qwen
```

A value that is not valid TOML is taken as a string (`--set teacher.path=/models/qwen`). Quote lists
with spaces for the shell (`--set "cache.bucket_edges=[128, 320]"`). *unset* means the key has no value
(it is left out of the preset); its description says what happens then. The resolved config is written
into the cache (`CACHE/meta/config.json`), the run dir (`RUN/config.json`) and every checkpoint.

Every command accepts the whole file (one preset serves both stages), and each checks the settings it
reads: *Read by* under each section names the commands. The checks between sections run only for the
command that reads them: `extract.tokens_per_batch` and `cache.bucket_edges` against `data.max_length` for
`dflash-extract`; `dflash-train` reads its samples' lengths from the cache and checks them against
`loader.tokens_per_batch` (and `loader.max_block_positions`) when it plans an epoch.
"""


def source_file(cls: type[Section]) -> str:
    """The file that declares a section, e.g. ``train/config.py``."""
    return cls.__module__.replace(".", "/") + ".py"


def sections() -> Iterator[tuple[str, type[Section]]]:
    """``(name, section class)`` in the schema's order."""
    for name, field in PipelineConfig.model_fields.items():
        yield name, field.annotation  # type: ignore[misc]


def toml_value(value: Any) -> str:
    """``value`` written as TOML (what ``--set key=value`` parses back to the same value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def default_of(field: FieldInfo) -> Any:
    return field.get_default(call_default_factory=True)


def _type_text(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in args if a is not type(None))
    if origin is Literal:
        return " / ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(_type_text(a) for a in args) + "]"
    if origin is dict:
        return "table"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
           (annotated_types.Le, "le", "<="))


def type_text(field: FieldInfo) -> str:
    """E.g. ``int > 0``, ``float >= 0, < 1``, ``"skip" / "error"``."""
    bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata for kind, attr, sign in _BOUNDS
              if isinstance(m, kind)]
    return " ".join([_type_text(field.annotation), ", ".join(bounds)]).strip()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole page."""
    out = [INTRO]
    out.append("Sections: " + ", ".join(f"[`[{name}]`](#{name})" for name, _ in sections()) + ".\n")
    for name, cls in sections():
        out.append(f"## {name}\n")
        out.append(_cell(cls.__doc__ or "") + f" Declared in `{source_file(cls)}`.\n")
        out.append(f"*Read by:* {_cell(SECTION_READERS[name])}.\n")
        out.append("| key | type | default | meaning |")
        out.append("|---|---|---|---|")
        for key, field in cls.model_fields.items():
            default = default_of(field)
            shown = "*unset*" if default is None else f"`{_cell(toml_value(default))}`"
            out.append(f"| `{name}.{key}` | {_cell(type_text(field))} | {shown} | {_cell(field.description or '')} |")
        out.append("")
    out.append("## Environment switches\n")
    out.append("Not config: the few `DFLASH_*` variables for where a config does not reach or must not "
               "(`dflash_cache/runtime/switches.py`, the only place that reads them).\n")
    out.append("| variable | meaning |")
    out.append("|---|---|")
    out.extend(f"| `{name}` | {_cell(text)} |" for name, text in SWITCHES.items())
    out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_cache.runtime.reference",
                                description="Write the config reference (docs/config.md) from the schema.")
    p.add_argument("--out", type=Path, default=PAGE, help="the page to write (default: docs/config.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/config.md is the schema: generated from it, every field described, every default valid as written.

The page is written by ``make docs`` (``python -m dflash_cache.runtime.reference``); these tests fail when
someone edits the schema without regenerating it, adds a field without a description, or when a
documented default could not be typed back with ``--set``.
"""

from __future__ import annotations

import pytest

from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.reference import PAGE, default_of, main, render, sections, toml_value

FIELDS = [(f"{name}.{key}", field) for name, cls in sections() for key, field in cls.model_fields.items()]


def test_page_is_generated_from_the_schema():
    assert PAGE.read_text() == render(), "docs/config.md differs from the schema: run `make docs`"


def test_check_mode_flags_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(render().replace("AdamW betas.", "AdamW betas (stale)."))
    assert main(["--out", str(stale), "--check"]) == 1
    assert "run `make docs`" in capsys.readouterr().err
    assert main(["--out", str(stale)]) == 0 and main(["--out", str(stale), "--check"]) == 0


def test_every_field_is_described_in_whole_sentences():
    bad = [key for key, field in FIELDS if not (field.description or "").strip().endswith((".", ")"))]
    assert not bad, f"schema fields without a description (a docstring under the field): {bad}"


def test_every_key_has_its_row_with_type_and_default():
    page = PAGE.read_text()
    for key, field in FIELDS:
        default = default_of(field)
        shown = "*unset*" if default is None else f"`{toml_value(default)}`"
        assert f"| `{key}` |" in page and f"| {shown} |" in page.split(f"| `{key}` |", 1)[1].split("\n", 1)[0], key


@pytest.mark.parametrize("key,field", [(k, f) for k, f in FIELDS if default_of(f) is not None],
                         ids=[k for k, f in FIELDS if default_of(f) is not None])
def test_documented_default_round_trips_through_set(key, field, tmp_path):
    """What the page shows is accepted by ``--set KEY=VALUE`` and means the default (e.g. train.betas is
    written [0.9, 0.95], not Python's (0.9, 0.95), which --set rejects)."""
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    section, name = key.split(".")
    cfg = load_config(empty, [f"{key}={toml_value(default_of(field))}"])
    assert getattr(getattr(cfg, section), name) == default_of(field)


def test_python_tuple_syntax_is_what_the_page_must_not_show(tmp_path):
    # the reason defaults are rendered as TOML: the repr of a tuple is not a value --set accepts
    from dflash_cache.errors import ConfigError

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="train.betas"):
        load_config(empty, ["train.betas=(0.9, 0.95)"])
    assert "`(0.9, 0.95)`" not in PAGE.read_text()


def test_the_pages_set_examples_are_accepted_by_the_preset_they_name():
    import re
    import shlex

    text = PAGE.read_text()
    commands = [line for line in text.splitlines() if line.startswith(("dflash-train configs/", "dflash-extract configs/"))]
    quoted = re.findall(r'`(--set "[^"]+")`', text)
    assert commands and quoted
    for line in commands + [f"x configs/tiny.toml {q}" for q in quoted]:
        argv = shlex.split(line)
        overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        load_config(argv[1], overrides)  # raises ConfigError naming the field if the example is wrong

"""``tests/mutation_check.py`` stays runnable: every mutant's edit applies exactly once to today's code and
names tests that exist (the full check, which runs each mutant's tests in a copy, is run by hand: see
docs/testing.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_still_applies_to_the_code(mutant):
    text = (ROOT / mutant.path).read_text()
    for old, new in mutant.edits:
        assert text.count(old) == 1, f"{mutant.name}: update its edit in tests/mutation_check.py:\n{old}"
        assert old != new
    for test in mutant.tests:
        file, _, name = test.partition("::")
        assert (ROOT / file).is_file(), test
        name = name.split("[", 1)[0]  # (a parametrized test's id names its function)
        assert not name or f"def {name}(" in (ROOT / file).read_text(), test

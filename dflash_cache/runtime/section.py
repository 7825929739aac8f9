"""The base of every config section, and the error form of a check across sections.

Each stage declares its own sections (``train/config.py``, ``extract/config.py``, ``dflash_cache/config.py``);
:mod:`dflash_cache.runtime.schema` composes them. Every field's docstring is its description:
``docs/config.md`` is generated from them (:mod:`dflash_cache.runtime.reference`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_core import InitErrorDetails, PydanticCustomError


class Section(BaseModel):
    # every field's docstring is its description: docs/config.md is generated from them
    # nan and inf are never a setting: refused with the field's name (nan would pass every range check)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


def field_error(loc: tuple[str, ...], value: object, message: str) -> InitErrorDetails:
    """One problem found by a check across sections, reported at the dotted field to change (``loc``)."""
    return InitErrorDetails(type=PydanticCustomError("cross_check", message), loc=loc, input=value)

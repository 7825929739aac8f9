"""TOML config loading with dotted ``--set`` overrides, validated by one pydantic schema.

Both stages use this: ``load_config(path, overrides)`` returns a validated
:class:`~dflash_cache.runtime.schema.PipelineConfig`; every problem is reported at once, each with
its dotted path (``train.lr: Input should be greater than 0``).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def parse_value(text: str) -> Any:
    """Parse the right-hand side of ``--set key=value`` as a TOML value, else keep it a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (a new dict is returned)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. train.lr=3e-4")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = parse_value(raw.strip())
    return out


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} problem(s) in the config:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/config.md)"
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)


def validate(model: type[M], data: Mapping[str, Any], source: str = "config", command: str | None = None) -> M:
    """``command`` (``dflash-extract`` / ``dflash-train``): run only the checks of the settings that command
    reads (``schema.SECTION_READERS``); None: every check."""
    try:
        return model.model_validate(dict(data), context={"command": command} if command else None)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def missing_config_message(p: Path) -> str:
    """Says where a missing config was looked for, and where the shipped preset of that name is."""
    where = "" if p.is_absolute() else f" (relative to the working directory {Path.cwd()})"
    shipped = Path(__file__).resolve().parents[2] / "configs" / p.name
    hint = (f"the preset of that name is {shipped}" if shipped.is_file()
            else "the presets live in the checkout's configs/, e.g. configs/tiny.toml")
    return f"config file {p} does not exist{where}; {hint}"


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(missing_config_message(p))
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{p}: not valid TOML: {err}") from None


def load_config(path: str | Path, overrides: Iterable[str] = (), model: type[M] | None = None,
                command: str | None = None) -> M:
    """Read a TOML preset, apply ``--set`` overrides and validate the result (for ``command``: see
    :func:`validate`)."""
    if model is None:
        from .schema import PipelineConfig

        model = PipelineConfig  # type: ignore[assignment]
    data = apply_overrides(read_toml(path), list(overrides))
    return validate(model, data, source=str(path), command=command)  # type: ignore[arg-type]


def config_to_dict(cfg: BaseModel) -> dict[str, Any]:
    """The resolved config as plain JSON-able data (written into caches, runs and checkpoints)."""
    return cfg.model_dump(mode="json")

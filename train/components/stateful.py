"""The state a checkpoint saves, registered by name: each component that must come back on a resume
(optimizer, scheduler, loader position, guard window) is a :class:`Stateful` registered under a name; the
checkpoint stores ``{name: component.state_dict()}`` and a resume loads each name into its component. A name
the checkpoint lacks, or one it holds that nothing registered, is refused with the name (nothing is silently
left at its initial state or silently dropped)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from dflash_cache.runtime.dist import Distributed

from .checkpoint import CheckpointError


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint needs from a component: its state as a (nested) dict, and the way back."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class StateMismatchError(CheckpointError):
    """A checkpoint's named state does not match the components this run registered."""


class PerRank:
    """A component whose state differs per rank (the loader reads its own slice of the plan): saved as the list
    of every rank's state (a collective: every rank calls :meth:`state_dict`), loaded from this rank's entry."""

    def __init__(self, part: Stateful, d: Distributed) -> None:
        self.part, self.d = part, d

    def state_dict(self) -> list[Any]:
        return self.d.gather_objects(self.part.state_dict())

    def load_state_dict(self, state: list[Any]) -> None:
        self.part.load_state_dict(state[self.d.rank])


class StateRegistry:
    """Named :class:`Stateful` components, saved and restored together, in registration order."""

    def __init__(self, reserved: tuple[str, ...] = ()) -> None:
        self._parts: dict[str, Stateful] = {}
        self.reserved = frozenset(reserved)  # keys the checkpoint stores beside the components (step, ...)

    def register(self, name: str, part: Stateful) -> StateRegistry:
        if name in self._parts or name in self.reserved:
            raise ValueError(f"state name {name!r} is already taken; register each component under its own name")
        if not isinstance(part, Stateful):
            raise TypeError(f"state {name!r}: a {type(part).__name__} has no state_dict()/load_state_dict()")
        self._parts[name] = part
        return self

    def __getitem__(self, name: str) -> Stateful:
        return self._parts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def names(self) -> list[str]:
        return list(self._parts)

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._parts.items()}

    def check(self, saved: Mapping[str, Any], where: str) -> None:
        """Refuse a saved state whose names differ from the registered ones (reserved keys aside)."""
        missing = [n for n in self._parts if n not in saved]
        unexpected = sorted(set(saved) - set(self._parts) - self.reserved)
        if missing or unexpected:
            what = "; ".join(s for s in (
                f"missing {', '.join(repr(n) for n in missing)}" if missing else "",
                f"unexpected {', '.join(repr(n) for n in unexpected)}" if unexpected else "") if s)
            raise StateMismatchError(
                f"checkpoint {where} does not hold the state this trainer restores ({what}; this run registers "
                f"{self.names()}). It was written by another version of the trainer: resume with that version, "
                "or start a new --run-dir (e.g. with model.init_from pointing at an export of that run)")

    def load_state_dict(self, saved: Mapping[str, Any], where: str = "state") -> None:
        """Load every registered name from ``saved`` (all names are checked before anything is loaded)."""
        self.check(saved, where)
        for name, part in self._parts.items():
            part.load_state_dict(saved[name])

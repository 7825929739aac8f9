"""The seams between training's parts, as typing Protocols: what the loop needs of a loader, what
the objective, evaluation and export need of a drafter, and what a step needs of the objective. Any class with
these members fits (tests check that the shipped ones do); nothing has to inherit from them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from .data.batch import Batch
    from .data.loader import BatchStats, LoaderCounters


class DrafterShape(Protocol):
    """The fields of a drafter's config that the objective reads."""

    block_size: int
    mask_token_id: int
    hidden_size: int
    target_layer_ids: Sequence[int]


@runtime_checkable
class Drafter(Protocol):
    """A drafter (``DFlashDrafter``, ``DFlash2Drafter``): cache features and the blocks to draft in, the
    final hidden states out; ``lm_head`` [V, H] turns them into logits (frozen, the teacher's)."""

    config: Any  # a DrafterShape (DFlashConfig / DFlash2Config)
    lm_head: Tensor

    def __call__(self, features: Tensor, block_ids: Tensor, block_positions: Tensor, layout: Any) -> Tensor:
        """features [R, T, n*H], block_ids / block_positions [A, B] -> hidden [A, B, H]."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[Tensor]: ...


@runtime_checkable
class Objective(Protocol):
    """The loss of one batch, as a step runs it (``LossModule``, or it wrapped in DDP)."""

    def __call__(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """-> (loss [], metrics: per-position accuracy, acceptance length, ...)."""
        ...


@runtime_checkable
class TrainingLoader(Protocol):
    """What the loop needs of a loader (``StreamingLoader``): an epoch's batches per iteration, the epoch
    lengths for the lr schedule, counters for the metrics, and a position a checkpoint saves."""

    counters: LoaderCounters
    last_stats: BatchStats | None

    def __iter__(self) -> Iterator[Batch]: ...

    def epoch_lengths(self, epochs: int) -> list[int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...

"""The one config schema of ``dflash-extract`` and ``dflash-train``, composed from each stage's sections.

A preset in ``configs/`` is a TOML file with these sections; unknown keys are errors. Each stage declares
its own sections next to its code, and each component receives only its own section (``cfg.cache``,
``cfg.loader`` ...), never the whole:

- ``teacher``, ``data``, ``regenerate``, ``extract``: :mod:`extract.config`;
- ``cache``: :mod:`dflash_cache.config`;
- ``model``, ``train``, ``loader``, ``checkpoint``, ``guards``, ``eval``, ``metrics``: :mod:`train.config`.

This module is the one place that composes them, and so the one module of ``dflash_cache`` that imports
from the stages (``tests/test_import_rules.py`` names it as the only exception to "``dflash_cache`` imports
neither stage"). It lives here because both commands load the same config and ``extract`` may not import
``train``: the composer must sit below both stages, and the layout has no package between them but the
shared runtime. The exception stays harmless because the stages' config modules are pydantic-only (no torch,
no stage code; tested): importing the schema loads no stage.

No component reads another stage's section (``tests/test_config_layout.py`` scans for it). The few values a
stage takes from another's section are resolved here, as properties of the composed config with the reason
beside each, so that the dependency is named in one place rather than buried in a component.
"""

from __future__ import annotations

from pydantic import Field, ValidationError, ValidationInfo, model_validator

from extract.config import DataConfig, ExtractConfig, RegenerateConfig, TeacherConfig
from extract.config import check_sections as check_extract_sections
from train.config import (
    CheckpointConfig,
    EvalConfig,
    GuardsConfig,
    LoaderConfig,
    MetricsConfig,
    ModelConfig,
    TrainConfig,
)
from train.config import check_sections as check_train_sections

from ..config import CacheConfig
from .section import Section, field_error

EXTRACT_COMMAND, TRAIN_COMMAND = "dflash-extract", "dflash-train"

# Which commands read each section (docs/config.md says it under each section's heading). A command checks the
# settings it reads, nothing else: extraction's checks against data.max_length never stop training, which reads
# its samples' lengths from the cache (and checks them against loader.tokens_per_batch when it plans).
SECTION_READERS: dict[str, str] = {
    "teacher": f"`{EXTRACT_COMMAND}`; `{TRAIN_COMMAND} eval --live` (the teacher decodes) and `{TRAIN_COMMAND} estimate` (the teacher's "
               "shapes, when no `--cache` gives them)",
    "data": f"`{EXTRACT_COMMAND}`; `{TRAIN_COMMAND} estimate` without `--cache` (`data.max_length` bounds the worst step). "
            f"`{TRAIN_COMMAND}` itself reads the samples' lengths from the cache",
    "regenerate": f"`{EXTRACT_COMMAND}` (regeneration through an endpoint)",
    "cache": f"`{EXTRACT_COMMAND}` (the cache it writes); `{TRAIN_COMMAND} estimate` without `--cache` (`cache.target_layer_ids`)",
    "extract": f"`{EXTRACT_COMMAND}` only",
    "model": f"`{TRAIN_COMMAND}` and its subcommands; `{EXTRACT_COMMAND}` reads `model.block_size` (the default of "
             "`data.min_loss_tokens`) and `model.mask_token_id` (recorded in the cache)",
    "train": f"`{TRAIN_COMMAND}` and its subcommands",
    "loader": f"`{TRAIN_COMMAND}` and its subcommands; `{EXTRACT_COMMAND}` reads `loader.num_readers` (training's CPU thread "
              "budget, kept by regeneration)",
    "checkpoint": f"`{TRAIN_COMMAND}`",
    "guards": f"`{TRAIN_COMMAND}`",
    "eval": f"`{TRAIN_COMMAND}` (evaluation during training) and `{TRAIN_COMMAND} eval`",
    "metrics": f"`{TRAIN_COMMAND}`",
}


class PipelineConfig(Section):
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _cross_check(self, info: ValidationInfo) -> PipelineConfig:
        """Checks across sections, each reported at the field to change: extraction's (the bucket edges and
        the forward's token budget against data.max_length) and training's, each only for the command that
        reads those settings (validation context ``{"command": EXTRACT_COMMAND or TRAIN_COMMAND}``; without one, both)."""
        command = (info.context or {}).get("command")
        errors = []
        if command in (None, EXTRACT_COMMAND):
            max_len = self.data.max_length
            over = [e for e in self.cache.bucket_edges if e >= max_len]
            if over:
                errors.append(field_error(
                    ("cache", "bucket_edges"), self.cache.bucket_edges,
                    f"edges {over} are not below data.max_length ({max_len}): samples are truncated to max_length, "
                    "so those buckets would stay empty; use edges below data.max_length (or raise it)"))
            errors += check_extract_sections(self.data, self.extract)
        if command in (None, TRAIN_COMMAND):
            errors += check_train_sections(self.model, self.train, self.loader)
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    # -- values one stage takes from another's section ------------------------------------------------------

    @property
    def min_loss_tokens(self) -> int:
        """Extraction's floor of loss tokens per sample: ``data.min_loss_tokens``, or two drafter blocks
        (2 x ``model.block_size``) when unset, since a sample shorter than that trains no full block."""
        return self.data.min_loss_tokens or 2 * self.model.block_size

    @property
    def mask_token_id(self) -> int | None:
        """The drafter's block-filler id (``model.mask_token_id``) that extraction records in the cache's spec
        (unset: the teacher tokenizer's); training then reads the cache's."""
        return self.model.mask_token_id

    @property
    def cpu_worker_threads(self) -> int:
        """Threads kept off torch's CPU compute by every command that runs a model on CPU: training's reader
        threads (``loader.num_readers``), so that regeneration and evaluation compute with training's thread
        budget."""
        return self.loader.num_readers

"""The config as the extract commands read it: the preset with ``--set``, ``--data`` and ``--skip-bad``
applied, and what the ``[data]`` section means for templating and the sample rules. Shared by extraction,
``estimate`` and ``regenerate`` (in-process and endpoint), so that all of them template a conversation the
same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_cache.errors import ConfigError
from dflash_cache.runtime.config import load_config
from dflash_cache.runtime.schema import PipelineConfig

from .template import SampleRules, TemplateOptions


def template_options(cfg: PipelineConfig) -> TemplateOptions:
    return TemplateOptions(cfg.data.system_prompt, cfg.data.enable_thinking)


def sample_rules(cfg: PipelineConfig) -> SampleRules:
    """The `data` section's tokenization rules, with the loss-token floor the composed config resolves."""
    return SampleRules(template_options(cfg), cfg.data.max_length, cfg.min_loss_tokens, cfg.data.skip_bad)



def load_run_config(path: str, overrides: Sequence[str], data: str | None, skip_bad: bool) -> PipelineConfig:
    cfg = load_config(path, overrides)
    try:
        if data is not None:
            cfg.data.path = data
        if skip_bad:
            cfg.data.skip_bad = True
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg



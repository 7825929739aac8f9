"""What the ``[data]`` section means for templating and the sample rules (the config itself is loaded, torch-free,
by :func:`extract.cli_args.load_run_config`). Shared by extraction,
``estimate`` and ``regenerate`` (in-process and endpoint), so that all of them template a conversation the
same way.
"""

from __future__ import annotations

from dflash_cache.runtime.schema import PipelineConfig

from .template import SampleRules, TemplateOptions


def template_options(cfg: PipelineConfig) -> TemplateOptions:
    return TemplateOptions(cfg.data.system_prompt, cfg.data.enable_thinking)


def sample_rules(cfg: PipelineConfig) -> SampleRules:
    """The `data` section's tokenization rules, with the loss-token floor the composed config resolves."""
    return SampleRules(template_options(cfg), cfg.data.max_length, cfg.min_loss_tokens, cfg.data.skip_bad)



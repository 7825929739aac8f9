"""``dflash-train export CHECKPOINT_OR_RUN_DIR --out DIR``: an HF drafter directory for serving.

The output is what SGLang / vLLM load as a DFlash draft model: ``config.json`` (architecture
``DFlashDraftModel``, ``dflash_config`` {``target_layer_ids``, ``mask_token_id``}, ``block_size`` and
the Qwen3 fields) and ``model.safetensors`` with the released drafters' weight names (no embedding,
no lm_head: the engine uses the target's), plus ``dflash.py``, the transformers modeling file that
``config.json``'s ``auto_map`` names, so ``AutoModel.from_pretrained(out, trust_remote_code=True)``
loads it (docs/serving.md). A run directory means its latest committed checkpoint.

Within-block causality: the engines infer the rule from the layer type unless told (sliding = causal,
full = bidirectional in the reference, SGLang and vLLM by default), so a drafter whose layers differ from
that default also gets ``is_causal`` and ``dflash_config.causal``, the explicit switches they read
(``DFlashConfig.causality_keys``). A drafter whose ``target_layer_ids`` include the teacher's last layer
exports with a warning: SGLang cannot serve it.

The drafter config needs the target's vocabulary size and layer ids, which live in the cache spec:
they are read from the checkpoint's weights metadata when present, else from ``--cache``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflash_cache.errors import ConfigError, SpecMismatchError
from dflash_cache.runtime.config import validate
from dflash_cache.runtime.schema import TRAIN_COMMAND, PipelineConfig

from ..cli_args import export_parser as build_parser
from ..components.checkpoint import MANIFEST_FILE
from ..models.factory import drafter_class
from ..models.model import (
    METADATA_KEY,
    DFlashConfig,
    check_compatible,
    drafter_config,
    from_contract_names,
    read_drafter_config,
    save_drafter_weights,
    warn_serving_limits,
)

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODELING_FILE = "dflash.py"  # the name config.json's auto_map ("dflash.DFlashDraftModel") points to


def modeling_source() -> Path:
    """The shipped modeling file (package data: depends on torch + transformers only)."""
    return Path(__file__).parents[1] / "models" / "hf_modeling" / MODELING_FILE


def serving_config(cfg: DFlashConfig, dtype: str) -> dict[str, Any]:
    """``config.json``: the drafter config (with the switches serving engines read for causality) in ``dtype``."""
    hf = cfg.to_hf_dict()
    hf["dtype"] = dtype
    return hf


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory (has ``manifest.json``), or a run dir's latest committed checkpoint."""
    p = Path(path)
    if (p / MANIFEST_FILE).is_file():
        return p
    if not p.is_dir():
        raise ConfigError(f"checkpoint {p} does not exist (expected RUN_DIR or RUN_DIR/checkpoints/step-XXXXXXXX)")
    from ..components.checkpoint import find_latest

    latest = find_latest(p)
    if latest is None:
        raise ConfigError(
            f"{p} has no committed checkpoint (no checkpoints/step-*/ with a valid manifest.json); "
            "train longer than checkpoint.every_steps or pass a checkpoint directory"
        )
    return latest


@dataclass
class LoadedDrafterWeights:
    """A drafter's weights and its config, from a run checkpoint or an exported/released directory."""

    state: dict[str, Tensor]
    config: DFlashConfig | None  # None: must be rebuilt from the pipeline config + a cache spec
    pipeline_config: PipelineConfig | None
    source: Path
    step: int | None = None
    cache_fingerprint: str | None = None


def is_drafter_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and (p / "model.safetensors").is_file() and not (p / MANIFEST_FILE).exists()


def load_weights(path: str | Path) -> LoadedDrafterWeights:
    """Read a checkpoint / run dir (checksums verified) or an exported or released drafter directory."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if is_drafter_dir(path):
        p = Path(path)
        state = from_contract_names(load_file(str(p / "model.safetensors")))
        return LoadedDrafterWeights(state, read_drafter_config(p), None, p)
    from ..components.checkpoint import read_checkpoint_model

    ckpt = resolve_checkpoint(path)
    state, config, manifest = read_checkpoint_model(ckpt)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        meta = f.metadata() or {}
    dcfg = DFlashConfig.from_json(meta[METADATA_KEY]) if METADATA_KEY in meta else None
    pcfg = validate(PipelineConfig, config, source=str(ckpt / "config.json"), command=TRAIN_COMMAND)
    return LoadedDrafterWeights(state, dcfg, pcfg, ckpt, int(manifest.get("step", -1)), manifest.get("cache_fingerprint"))


def config_for(loaded: LoadedDrafterWeights, spec: Any | None) -> DFlashConfig:
    """The drafter config of ``loaded``; checked against ``spec`` (the cache) when one is given."""
    expected = drafter_config(loaded.pipeline_config.model, spec) if spec is not None and loaded.pipeline_config else None
    cfg = loaded.config or expected
    if cfg is None:
        raise ConfigError(
            f"{loaded.source}: the checkpoint does not record the target's vocabulary and layer ids; "
            "pass --cache CACHE (the cache the drafter was trained on)"
        )
    if spec is not None:
        check_compatible(cfg, expected or _spec_view(cfg, spec), source=str(loaded.source))
    check_weights(loaded.state, cfg, str(loaded.source))
    return cfg


def _spec_view(cfg: DFlashConfig, spec: Any) -> DFlashConfig:
    """``cfg`` with the cache-determined fields taken from ``spec`` (for the compatibility check)."""
    d = json.loads(cfg.to_json())
    d.update(hidden_size=int(spec.teacher.hidden_size), vocab_size=int(spec.teacher.vocab_size),
             target_layer_ids=[int(i) for i in spec.target_layer_ids])
    d["mask_token_id"] = min(d["mask_token_id"], d["vocab_size"] - 1)  # checked on its own elsewhere
    return DFlashConfig(**d)


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Weight names and shapes of a drafter with ``cfg`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        head = torch.empty(cfg.vocab_size, cfg.hidden_size)
        model = drafter_class(cfg)(cfg, head, head)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_weights(state: dict[str, Tensor], cfg: DFlashConfig, source: str) -> None:
    """Names and shapes must be exactly the drafter's; a wrong fc width names the cache field."""
    expected = expected_shapes(cfg)
    fc = tuple(state["fc.weight"].shape) if "fc.weight" in state else None
    if fc is not None and fc != expected["fc.weight"]:
        field = "hidden_size" if fc[0] != cfg.hidden_size else "target_layer_ids"
        raise SpecMismatchError(
            f"{source}: fc.weight is {fc} but the config/cache needs {expected['fc.weight']} "
            f"({len(cfg.target_layer_ids)} target layers x hidden_size {cfg.hidden_size}): {field} differs; "
            "use the cache the drafter was trained on",
            fields=[field],
        )
    found = {k: tuple(v.shape) for k, v in state.items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))[:5]
        extra = sorted(set(found) - set(expected))[:5]
        wrong = sorted(k for k in set(found) & set(expected) if found[k] != expected[k])[:5]
        raise SpecMismatchError(
            f"{source}: weights do not match the drafter config (missing {missing}, unexpected {extra}, "
            f"wrong shape {[(k, found[k], expected[k]) for k in wrong]})",
            fields=["weights"],
        )


def export_drafter(state: dict[str, Tensor], cfg: DFlashConfig, out: str | Path, *, dtype: str = "bfloat16",
                   overwrite: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out`` (built in ``out.tmp``, then renamed)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
    check_weights(state, cfg, "export")
    warn_serving_limits(cfg, "export")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} exists and is not empty; choose another --out or pass --overwrite")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf = serving_config(cfg, dtype)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(modeling_source(), tmp / MODELING_FILE)
    with torch.device("meta"):
        head = torch.empty(cfg.vocab_size, cfg.hidden_size)
        holder = drafter_class(cfg)(cfg, head, head)
    holder.to_empty(device="cpu")
    holder.load_state_dict(state)
    save_drafter_weights(holder, tmp / "model.safetensors", dtype=_DTYPES[dtype])
    # safetensors creates its file 0600; a server running as another user must read the weights like the
    # config: the same mode as config.json (0666 less the umask)
    os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("exported the drafter to %s (%d tensors, %s)", out, len(state), dtype)
    return out


def cli_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    loaded = load_weights(args.checkpoint)
    spec = None
    if args.cache:
        from dflash_cache import open_cache

        spec = open_cache(args.cache).spec
    cfg = config_for(loaded, spec)
    out = export_drafter(loaded.state, cfg, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported {loaded.source} -> {out}")
    return 0

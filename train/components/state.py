"""What a resume needs beyond the weights: the training state dict, and the checks that the
checkpoint belongs to this cache, this job shape and this config before anything is loaded."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from dflash_cache.errors import ConfigError, DFlashError, SpecMismatchError
from dflash_cache.protocols import ReadableCache
from dflash_cache.runtime.dist import Distributed
from train.config import CheckpointConfig

from .checkpoint import Checkpointer, CheckpointError, LoadedCheckpoint, list_checkpoints
from .guards import SpikeGuard
from .metrics import METRICS_FILE, archive_metrics, read_metrics
from .multinode import agree_on_resume, run_fingerprint
from .optim import check_optimizer_state
from .stateful import PerRank, StateRegistry

log = logging.getLogger(__name__)

# How each config field takes part in a resume; the longest matching dotted prefix decides.
#   "result": the resumed run would compute something else (model shape, optimizer, lr schedule ...): a change
#             is refused unless checkpoint.allow_config_change, and then applies from the resumed step on;
#   "plan":   the loader resumes at a batch index of the plan these fields shape: a change is always refused;
#   "free":   bookkeeping, speed and safety knobs (logging, eval, checkpoint cadence, guards, reader threads):
#             a change is logged. Extraction's sections are checked through the cache fingerprint instead.
# tests/test_rundir.py checks that every schema field is covered.
RESUME_RULES: dict[str, str] = {
    "teacher": "free", "data": "free", "regenerate": "free", "cache": "free", "extract": "free",
    "model": "result",
    "train": "result",
    "train.seed": "plan",
    "train.logits_chunk_rows": "free",  # memory bound of the loss; same result
    "loader": "free",
    "loader.tokens_per_batch": "plan", "loader.max_block_positions": "plan", "loader.packing": "plan",
    "loader.pack_row_tokens": "plan", "loader.sort_window": "plan", "loader.holdout_fraction": "plan",
    "loader.live": "plan", "loader.locality_parts": "plan",
    "loader.locality_run_samples": "plan",
    "checkpoint": "free", "guards": "free", "eval": "free", "metrics": "free",
}


def resume_rule(field: str) -> str:
    """The :data:`RESUME_RULES` class of a dotted config field."""
    parts = field.split(".")
    for n in range(len(parts), 0, -1):
        rule = RESUME_RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    return "result"  # an unclassified field: the safe side


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        return {k: v for key, sub in d.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: d}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, list[str]]:
    """Fields whose value differs, by :func:`resume_rule` class, each as ``"field: old -> new"``."""
    old, new = _flatten(saved), _flatten(json.loads(json.dumps(current)))  # tuples compare as JSON lists
    out: dict[str, list[str]] = {"result": [], "plan": [], "free": []}
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            was, now = (json.dumps(c[key]) if key in c else "<absent>" for c in (old, new))
            out[resume_rule(key)].append(f"{key}: {was} -> {now}")
    return out


def check_config_compatible(ckpt: LoadedCheckpoint, current: dict[str, Any], allow_change: bool) -> bool:
    """Refuse a resume whose config changes the result (unless allowed) or the data plan; log free changes.
    Returns whether result-changing fields changed (their new values must then be applied)."""
    changes = config_changes(ckpt.config, current)
    if changes["plan"]:
        raise ConfigError(
            f"checkpoint {ckpt.path} was trained with another data plan; changed: {'; '.join(changes['plan'])}. "
            "The loader resumes at a batch index of the saved plan, so these cannot change mid-run: restore them, "
            "or start a new --run-dir (e.g. with model.init_from pointing at an export of this run)"
        )
    if changes["result"] and not allow_change:
        raise ConfigError(
            f"the config differs from checkpoint {ckpt.path}'s in fields that change the result: "
            f"{'; '.join(changes['result'])}. Rerun with the checkpoint's values (see {ckpt.path / 'config.json'}), "
            "use a new --run-dir, or apply the change from this step on with "
            "--set checkpoint.allow_config_change=true"
        )
    if changes["result"]:
        log.warning("resuming %s with a changed config (checkpoint.allow_config_change): %s", ckpt.path,
                    "; ".join(changes["result"]))
    if changes["free"]:
        log.info("resuming with changed settings that do not change the result: %s", "; ".join(changes["free"]))
    return bool(changes["result"])


# the model fields that decide which weights the drafter has and their shapes (its family and size); a
# checkpoint's weights load only into a model built with the same values, so none can change within a run dir
WEIGHT_FIELDS = ("model.arch", "model.num_hidden_layers", "model.num_attention_heads", "model.num_key_value_heads",
                 "model.head_dim", "model.intermediate_size", "model.conv_kernel_size", "model.conv_group_size",
                 "model.selector_rank")


def check_model_shape(ckpt: LoadedCheckpoint, model_state: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a checkpoint whose weights (names or shapes) are not those of the model this config builds,
    naming the changed :data:`WEIGHT_FIELDS` (or, failing that, the first differing weights)."""
    saved = {k: tuple(v.shape) for k, v in ckpt.model.items()}
    built = {k: tuple(v.shape) for k, v in model_state.items()}
    if saved == built:
        return
    changed = [c for c in config_changes(ckpt.config, current)["result"] if c.split(":")[0] in WEIGHT_FIELDS]
    if not changed:
        changed = [f"weight {k}: {list(saved[k]) if k in saved else '<absent>'} -> "
                   f"{list(built[k]) if k in built else '<absent>'}"
                   for k in sorted(set(saved) | set(built)) if saved.get(k) != built.get(k)][:3]
    raise ConfigError(
        f"checkpoint {ckpt.path} holds a drafter of another family or size than this config builds; changed: "
        f"{'; '.join(changed)}. A run dir keeps one model (not even checkpoint.allow_config_change changes it): "
        f"rerun with the checkpoint's values (see {ckpt.path / 'config.json'}), or train the new model in a new "
        "--run-dir"
    )


def check_resumable(run_dir: Path, discard_invalid: bool) -> None:
    """Called when no checkpoint of ``run_dir`` is valid: refuse to restart from step 0 over checkpoints that
    exist (torn or corrupt), unless ``discard_invalid`` moves them aside; a metrics file of an attempt that
    never committed a checkpoint is moved aside (its steps are recomputed)."""
    found = list_checkpoints(run_dir)
    if found and not discard_invalid:
        raise CheckpointError(
            f"{run_dir} holds {len(found)} checkpoint(s) ({', '.join(p.name for _, p in found)}) but none is valid "
            f"(see the warnings above), and {len(read_metrics(run_dir))} logged steps in {METRICS_FILE}; starting "
            "from step 0 would overwrite them. Restore a checkpoint, use a new --run-dir, or start over here with "
            "--set checkpoint.discard_invalid=true (moves them to RUN/discarded-<time>/)"
        )
    if found:
        target = run_dir / f"discarded-{int(time.time())}"
        target.mkdir()
        for name in ("checkpoints", METRICS_FILE):
            if (run_dir / name).exists():
                os.replace(run_dir / name, target / name)
        log.warning("no valid checkpoint in %s: moved %s and the metrics to %s; starting from step 0 "
                    "(checkpoint.discard_invalid)", run_dir, [p.name for _, p in found], target)
        return
    moved = archive_metrics(run_dir)
    if moved is not None:
        log.warning("%s held the metrics of an attempt that committed no checkpoint; they are kept in %s and "
                    "training starts from step 0", run_dir, moved)


# what the checkpoint stores beside the registered components: checked on resume, not loaded into anything
METADATA = ("step", "world_size", "cache_spec")


def training_components(optimizer, scheduler, loader, guard: SpikeGuard, d: Distributed) -> StateRegistry:
    """The components a resume restores, by name; the loader position is per rank (each rank reads its own
    slice). No RNG state: training draws no global random numbers (the plan and the anchors come from generators
    seeded per batch; dropout is 0), and tests/test_resume_state.py checks that every piece saved is restored."""
    return (StateRegistry(reserved=METADATA)
            .register("optimizer", optimizer)
            .register("scheduler", scheduler)
            .register("loader", PerRank(loader, d))
            .register("guard", guard))


def training_state(step: int, components: StateRegistry, cache: ReadableCache, d: Distributed) -> dict[str, Any]:
    """Everything a resume needs: the registered components' states under their names, and the metadata that
    a resume checks (step, world size, the cache's spec)."""
    return {"step": step, "world_size": d.world_size, **components.state_dict(), "cache_spec": cache.spec.to_dict()}


def check_cache_compatible(ckpt: LoadedCheckpoint, cache: ReadableCache, ignore: bool) -> None:
    """Refuse to resume on a cache other than the one the checkpoint was trained on."""
    saved_fp = ckpt.manifest.get("cache_fingerprint")
    if saved_fp == cache.spec.fingerprint:
        return
    from dflash_cache.spec import CacheSpec

    saved = CacheSpec.from_dict(ckpt.state["cache_spec"])
    fields = saved.diff(cache.spec) or ["fingerprint"]
    detail = ", ".join(fields)
    if ignore:
        log.warning("resuming %s on a cache that differs in %s (checkpoint.ignore_fingerprint_mismatch)",
                    ckpt.path, detail)
        return
    raise SpecMismatchError(
        f"checkpoint {ckpt.path} was trained on cache fingerprint {saved_fp}, but {cache.url} has "
        f"{cache.spec.fingerprint} (differs in: {detail}); use the original cache, a new --run-dir, or "
        "--set checkpoint.ignore_fingerprint_mismatch=true to resume anyway",
        fields=fields,
    )


def resume(ckpt_cfg: CheckpointConfig, ckpt: Checkpointer, cache: ReadableCache, model, components: StateRegistry,
           d: Distributed) -> int:
    """Load the latest valid checkpoint of the run into the model and every registered component (a name
    missing from the checkpoint or unknown to this run is refused); returns its step (0: none)."""
    latest = ckpt.load_latest()
    # every rank must start from the same step of the same run (node-local run dirs would not)
    agree_on_resume(d, 0 if latest is None else latest.step, run_fingerprint(ckpt.config, cache.spec.fingerprint),
                    ckpt.root.parent)
    if latest is None:
        if d.is_main:
            check_resumable(ckpt.root.parent, ckpt_cfg.discard_invalid)
        return 0
    if not ckpt_cfg.resume:
        raise DFlashError(
            f"checkpoint.resume is false but {latest.path.parent} already holds checkpoints (latest: step "
            f"{latest.step}); starting over there would mix two runs. Use a new --run-dir, or delete "
            f"{latest.path.parent} to start this one from scratch"
        )
    check_cache_compatible(latest, cache, ckpt_cfg.ignore_fingerprint_mismatch)
    saved_world = int(latest.state["world_size"])
    if saved_world != d.world_size:
        raise DFlashError(
            f"checkpoint {latest.path} was written by a run with {saved_world} process(es), this run has "
            f"{d.world_size}; each rank resumes its own slice of the plan, so resume with "
            f"--nproc-per-node {saved_world} (or start a new --run-dir)"
        )
    check_model_shape(latest, model.state_dict(), ckpt.config)  # even with allow_config_change: weights cannot
    changed = check_config_compatible(latest, ckpt.config, ckpt_cfg.allow_config_change)
    components.check(latest.state, str(latest.path))
    optimizer, scheduler = components["optimizer"], components["scheduler"]
    check_optimizer_state(optimizer, latest.state["optimizer"], str(latest.path))
    fresh = _hyperparameters(optimizer, scheduler)  # what this run's config asks for
    model.load_state_dict(latest.model)
    components.load_state_dict(latest.state, str(latest.path))
    if changed:  # the loaded state carries the old lr / betas / weight decay: the new config wins from here
        _apply_hyperparameters(optimizer, scheduler, fresh)
    log.info("resumed from %s (step %d)", latest.path, latest.step)
    return latest.step


def _hyperparameters(optimizer, scheduler) -> tuple[list[dict[str, Any]], list[float]]:
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]
    return groups, list(scheduler.base_lrs)


def _apply_hyperparameters(optimizer, scheduler, fresh: tuple[list[dict[str, Any]], list[float]]) -> None:
    """Put a freshly built optimizer's settings and the new peak lr into the loaded optimizer / scheduler,
    with the lr of the resumed step under the new schedule."""
    groups, base_lrs = fresh
    scheduler.base_lrs = list(base_lrs)
    for g, settings, base, fn in zip(optimizer.param_groups, groups, base_lrs, scheduler.lr_lambdas, strict=True):
        g.update(settings)
        g["lr"] = base * fn(scheduler.last_epoch)

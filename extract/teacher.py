"""The teacher: loading (HF transformers) and feature capture with forward hooks.

Layer id ``k`` means HF ``hidden_states[k + 1]`` for every ``k`` in ``0..L-1``: the output of decoder layer
``k``, except for the last layer, where HF's ``hidden_states[L]`` is the decoder's ``last_hidden_state``
(after the final norm), so the capture of ``k = L-1`` is taken there too. Serving engines and the
reference drafter read ``hidden_states[k + 1]``; a drafter trained on anything else accepts less.
Hooks sit on the chosen decoder layers only (and on the decoder itself when ``L-1`` is chosen); by
default the forward stops right after the deepest chosen layer, so neither the remaining layers nor
the vocabulary logits are computed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_cache.config import CacheConfig
from dflash_cache.errors import ConfigError
from dflash_cache.runtime.dist import launcher_env
from dflash_cache.runtime.log import process_rank

from .config import TeacherConfig
from .tiny import BUILTIN_TEACHERS, resolve_tiny_teacher

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARGMAX_CHUNK_TOKENS = 2048  # lm_head rows computed at a time when only the argmax is wanted
# Optional GPU kernels by teacher layer type, as (module, pip package): without them transformers runs
# these layers in its reference PyTorch code (correct, but many times slower on long sequences).
FAST_KERNELS = {
    "linear_attention": (("fla", "flash-linear-attention"), ("causal_conv1d", "causal-conv1d")),  # Gated DeltaNet
}


def resolve_teacher_path(path: str) -> str:
    """``builtin:tiny[-ARCH]`` -> the locally built tiny teacher; anything else is returned unchanged."""
    if path in BUILTIN_TEACHERS:
        return str(resolve_tiny_teacher(arch=BUILTIN_TEACHERS[path]))
    if path.startswith("builtin:"):
        raise ConfigError(f"teacher.path {path!r}: unknown built-in teacher; expected one of {sorted(BUILTIN_TEACHERS)}")
    return path


def resolve_device(device: str) -> torch.device:
    """``auto`` = ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", launcher_env().local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def rank_gpu_group(local_rank: int, local_world_size: int, n_gpus: int) -> list[int]:
    """The GPUs of this process when ``local_world_size`` processes share ``n_gpus`` GPUs of a node.

    With ``teacher.device_map`` a teacher too big for one GPU spans a group: 8 GPUs and 4 processes
    per node give each process 2 consecutive GPUs (rank 0: [0, 1], rank 1: [2, 3], ...).
    """
    if n_gpus < local_world_size or n_gpus % local_world_size:
        raise ConfigError(
            f"teacher.device_map: {local_world_size} processes on a node with {n_gpus} GPU(s) cannot split them "
            "into equal groups; start a number of processes per node that divides the GPU count "
            "(e.g. torchrun --nproc-per-node 4 for 8 GPUs and a teacher needing 2)"
        )
    size = n_gpus // local_world_size
    return list(range(local_rank * size, (local_rank + 1) * size))


def _group_max_memory() -> dict[Any, int] | None:
    """``max_memory`` confining ``device_map`` placement to this process's GPU group (None: all GPUs)."""
    env = launcher_env()
    if env.local_world_size <= 1 or not torch.cuda.is_available():
        return None
    group = rank_gpu_group(env.local_rank, env.local_world_size, torch.cuda.device_count())
    log.info("teacher placed over GPUs %s of this node (local rank %d)", group, env.local_rank)
    return {i: torch.cuda.get_device_properties(i).total_memory for i in group}


def _offline_requested() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def download_hint(path: str) -> str:
    return (f"download it where the hub is reachable (hf download {path} --local-dir DIR; with huggingface_hub < 1.0: "
            f"huggingface-cli download {path} --local-dir DIR) and set teacher.path to that directory "
            "(--set teacher.path=DIR); see docs/troubleshooting.md")


@functools.cache
def _check_hub_serves(path: str, revision: str | None) -> None:
    """One quick request (no retries) before anything is downloaded: an unreachable hub or an unknown model is
    an error at once, not minutes of retry warnings."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    where = f"teacher.path {path!r} is not a local directory and not in the local Hugging Face cache"
    try:
        HfApi().model_info(path, revision=revision, timeout=10)
    except GatedRepoError:
        raise ConfigError(f"{where}, and it is a gated model on the hub: accept its licence on the model page and "
                          f"log in (hf auth login), or {download_hint(path)}") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{where}, and the hub has no revision {revision!r} of it (teacher.revision)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}, and the hub has no model of that name (or it is private: log in with hf auth "
                          "login); check the spelling, or set teacher.path to a local model directory") from None
    except Exception as err:  # connection refused, DNS failure, timeout, proxy error: all mean "unreachable"
        raise ConfigError(f"{where}, and the hub is unreachable ({type(err).__name__}: {err}); "
                          f"{download_hint(path)}") from None


def from_pretrained(load: Any, teacher_cfg: TeacherConfig, what: str, **kwargs: Any) -> Any:
    """``load(path, ...)`` (a transformers ``from_pretrained``) for ``teacher.path``: a local directory as it is;
    a hub id from the local Hugging Face cache first, and from the hub only when that fails, the user did not
    ask for offline mode (``HF_HUB_OFFLINE``) and one quick request shows the hub can serve it. Every failure
    is one :class:`ConfigError` saying what to do."""
    path = resolve_teacher_path(teacher_cfg.path)
    kwargs.update(revision=teacher_cfg.revision, trust_remote_code=teacher_cfg.trust_remote_code)
    if not Path(path).is_dir():
        try:
            return load(path, local_files_only=True, **kwargs)
        except OSError:
            pass  # not (completely) in the local cache
        if _offline_requested():
            raise ConfigError(f"teacher.path {path!r} is not a local directory and not in the local Hugging Face "
                              f"cache, and offline mode is on (HF_HUB_OFFLINE); {download_hint(path)}")
        _check_hub_serves(path, teacher_cfg.revision)
    try:
        return load(path, **kwargs)
    except OSError as err:
        hint = "" if Path(path).is_dir() else f"; {download_hint(path)}"
        raise ConfigError(f"teacher.path {teacher_cfg.path!r}: could not load {what} ({err}){hint}") from None


def load_tokenizer(teacher_cfg: TeacherConfig) -> Any:
    """The teacher's tokenizer (no weights are loaded)."""
    from transformers import AutoTokenizer

    return from_pretrained(AutoTokenizer.from_pretrained, teacher_cfg, "a tokenizer")


def resolve_mask_token(mask_token_id: int | None, tokenizer: Any, vocab_size: int) -> tuple[int, str]:
    """``(id, source)`` of the drafter's mask token for this teacher, recorded in the cache spec.

    ``model.mask_token_id`` wins when set (source ``"config"``; the Qwen3 presets set it to a reserved
    id of their vocabulary); else the tokenizer's own mask token (``"tokenizer"``); else an error.
    """
    if mask_token_id is not None:
        found, source, what = int(mask_token_id), "config", f"model.mask_token_id = {mask_token_id}"
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        found, source = int(tokenizer.mask_token_id), "tokenizer"
        what = f"the tokenizer's mask token {tokenizer.mask_token!r} (id {found})"
    else:
        raise ConfigError(
            "model.mask_token_id is not set and the teacher's tokenizer has no mask token: the drafter fills its "
            "blocks with a reserved id of the teacher vocabulary, recorded in the cache at extraction. Set "
            f"model.mask_token_id to an id below {vocab_size} that the tokenizer never produces (Qwen3: 151669, "
            "Qwen3.5/3.6: 248070, as in configs/)"
        )
    if not 0 <= found < vocab_size:
        raise ConfigError(f"{what} is outside the teacher vocabulary [0, {vocab_size}); set model.mask_token_id "
                          "to a reserved id of the teacher vocabulary")
    return found, source


def load_teacher_config(teacher_cfg: TeacherConfig) -> Any:
    """The teacher's HF text config (no weights are loaded)."""
    from transformers import AutoConfig

    return from_pretrained(AutoConfig.from_pretrained, teacher_cfg, "config.json").get_text_config()


def missing_kernels(text_config: Any) -> dict[str, list[str]]:
    """``layer type -> pip packages not installed`` for the optional fast kernels the teacher's layers use."""
    types = set(getattr(text_config, "layer_types", None) or ())
    out = {}
    for kind in sorted(types & FAST_KERNELS.keys()):
        missing = [pip for module, pip in FAST_KERNELS[kind] if importlib.util.find_spec(module) is None]
        if missing:
            out[kind] = missing
    return out


def kernel_hint(missing: dict[str, list[str]]) -> str:
    """One sentence naming the slow layers and the install command (empty when nothing is missing)."""
    if not missing:
        return ""
    packages = sorted({p for ps in missing.values() for p in ps})
    return (f"the teacher's {' and '.join(missing)} layers run in transformers' slow PyTorch fallback on GPU "
            f"without {', '.join(packages)}: pip install {' '.join(packages)}")


def warn_missing_kernels(text_config: Any, device: torch.device) -> None:
    """Say once (rank 0) that a CUDA teacher lacks optional kernels; on CPU they would not be used anyway."""
    hint = kernel_hint(missing_kernels(text_config))
    if hint and device.type == "cuda" and process_rank() == 0:
        log.warning(hint)
    elif hint:
        log.debug(hint)


def load_teacher(teacher_cfg: TeacherConfig) -> tuple[nn.Module, Any]:
    """Load ``(model, tokenizer)`` in eval mode with gradients off, on ``teacher.device`` (or a device_map)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(dtype=_DTYPES[teacher_cfg.dtype])
    if teacher_cfg.attn_implementation:
        kwargs["attn_implementation"] = teacher_cfg.attn_implementation
    if teacher_cfg.device_map:
        kwargs["device_map"] = teacher_cfg.device_map
        max_memory = _group_max_memory()  # several processes per node: each spans its own GPU group
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
    model = from_pretrained(AutoModelForCausalLM.from_pretrained, teacher_cfg, "the model", **kwargs)
    if not teacher_cfg.device_map:
        model.to(resolve_device(teacher_cfg.device))
    model.eval().requires_grad_(False)
    warn_missing_kernels(model.config.get_text_config(), teacher_device(model))
    return model, load_tokenizer(teacher_cfg)


def teacher_device(model: nn.Module) -> torch.device:
    """Where inputs go: the device of the input embedding."""
    return model.get_input_embeddings().weight.device


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer stack (``model.model.layers`` for Qwen3; the longest ModuleList otherwise)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ConfigError(f"{type(model).__name__}: found no decoder layer list to hook")
    return max(lists, key=len)


def _decoder(model: nn.Module) -> nn.Module:
    """The module whose output is ``last_hidden_state`` (``model.model`` for Qwen3 / Llama)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ConfigError(f"{type(model).__name__}: found no decoder module whose output is HF's last hidden state; "
                          "choose target layers below the last one")
    return decoder


def _last_is_post_norm(decoder: nn.Module) -> bool:
    """Whether HF's ``hidden_states[L]`` is the decoder's normed ``last_hidden_state`` (true for all causal
    LMs unless a config sets ``tie_last_hidden_states = False``)."""
    return getattr(getattr(decoder, "config", None), "tie_last_hidden_states", None) is not False


def num_decoder_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def default_layer_ids(num_layers: int, n: int) -> list[int]:
    """``n`` layer ids spaced uniformly from 1 to L-3 (36, 5 -> [1, 9, 17, 25, 33])."""
    lo, hi = 1, max(num_layers - 3, 1)
    if n < 1 or n > hi - lo + 1:
        raise ConfigError(
            f"cache.num_target_layers = {n}: a {num_layers}-layer teacher has only {hi - lo + 1} layers in "
            f"[{lo}, {hi}]; choose fewer layers or set cache.target_layer_ids explicitly"
        )
    if n == 1:
        return [lo]
    return [lo + (2 * i * (hi - lo) + (n - 1)) // (2 * (n - 1)) for i in range(n)]


def resolve_layer_ids(cache_cfg: CacheConfig, num_layers: int) -> list[int]:
    """``cache.target_layer_ids`` validated against the teacher, or the default spacing."""
    if cache_cfg.target_layer_ids is None:
        return default_layer_ids(num_layers, cache_cfg.num_target_layers)
    ids = list(cache_cfg.target_layer_ids)
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ConfigError(
            f"cache.target_layer_ids = {ids}: {bad} out of range for a teacher with {num_layers} decoder "
            f"layers (valid: 0..{num_layers - 1}); layer k is the output of decoder layer k"
        )
    if sorted(set(ids)) != ids:
        raise ConfigError(f"cache.target_layer_ids = {ids}: expected strictly increasing layer ids")
    return ids


class _StopForward(Exception):
    """Raised by the deepest hook to skip the rest of the forward."""


class LayerCapture:
    """Forward hooks that keep the outputs of ``layer_ids`` (and optionally stop after the deepest).

    with LayerCapture(model, [1, 9, 17]) as cap:
        cap.forward(input_ids=ids, attention_mask=mask)   # or model(...) directly
    feats = cap.features()                                # [B, T, n*H]
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], stop_after_last: bool = True):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.stop_after_last = stop_after_last
        self._layers = decoder_layers(model)
        self._handles: list[Any] = []
        self._outputs: dict[int, torch.Tensor] = {}
        resolve_layer_ids(CacheConfig(target_layer_ids=self.layer_ids), len(self._layers))

    def _hook(self, layer_id: int):
        deepest = max(self.layer_ids)

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if hasattr(output, "last_hidden_state"):  # the decoder's output: HF's hidden_states[L]
                hidden = output.last_hidden_state  # [B, T, H]
            else:
                hidden = output[0] if isinstance(output, tuple) else output  # [B, T, H]
            self._outputs[layer_id] = hidden
            if self.stop_after_last and layer_id == deepest:
                raise _StopForward

        return hook

    def __enter__(self) -> LayerCapture:
        self._outputs.clear()
        last = len(self._layers) - 1
        for k in self.layer_ids:
            module = self._layers[k]
            if k == last:  # HF's hidden_states[L] is the decoder's output (after the final norm)
                decoder = _decoder(self.model)
                module = decoder if _last_is_post_norm(decoder) else module
            self._handles.append(module.register_forward_hook(self._hook(k)))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return exc_type is _StopForward

    def forward(self, **inputs: Any) -> Any:
        """Run ``model(**inputs)``; returns its output, or None when the forward stopped early."""
        try:
            return self.model(**inputs)
        except _StopForward:
            return None

    def features(self) -> torch.Tensor:
        """``[B, T, n*H]``: the captured layers concatenated in ``layer_ids`` order (on the first one's device)."""
        missing = [k for k in self.layer_ids if k not in self._outputs]
        if missing:
            raise RuntimeError(f"layers {missing} were not captured: run a forward inside the context first")
        first = self._outputs[self.layer_ids[0]]
        return torch.cat([self._outputs[k].to(first.device) for k in self.layer_ids], dim=-1)


@torch.inference_mode()
def capture_features(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_ids: Sequence[int],
    with_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(features [B, T, n*H], logits [B, T, V] | None)``; without logits the forward stops early."""
    with LayerCapture(model, layer_ids, stop_after_last=not with_logits) as cap:
        out = cap.forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return cap.features(), (out.logits if with_logits else None)


@torch.inference_mode()
def capture_features_and_argmax(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [B, T, n*H], argmax [B, T])``: the full stack runs, logits are formed in token chunks."""
    with LayerCapture(model, layer_ids, stop_after_last=False) as cap:
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state  # [B, T, H], after the final norm
    head = model.get_output_embeddings()
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*T, H]
    parts = [head(flat[i : i + ARGMAX_CHUNK_TOKENS]).argmax(-1) for i in range(0, len(flat), ARGMAX_CHUNK_TOKENS)]
    return cap.features(), torch.cat(parts).reshape(hidden.shape[:2])


@torch.inference_mode()
def capture_features_and_final(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: Sequence[int],
    with_argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(features [B, T, (n+1)*H], argmax [B, T] | None)``: the chosen layers, then the teacher's final normed
    hidden state (HF ``hidden_states[-1]``, the decoder's ``last_hidden_state``, what the lm_head reads) as one
    more H-wide slot. The whole stack runs; logits only when the argmax is asked for (in token chunks)."""
    with LayerCapture(model, layer_ids, stop_after_last=False) as cap:
        out = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    final = out.last_hidden_state  # [B, T, H], after the final norm
    feats = cap.features()  # [B, T, n*H]
    argmax = None
    if with_argmax:
        head = model.get_output_embeddings()
        flat = final.reshape(-1, final.shape[-1])  # [B*T, H]
        argmax = torch.cat([head(flat[i : i + ARGMAX_CHUNK_TOKENS]).argmax(-1)
                            for i in range(0, len(flat), ARGMAX_CHUNK_TOKENS)]).reshape(final.shape[:2])
    return torch.cat([feats, final.to(feats.device, feats.dtype)], dim=-1), argmax


def teacher_name(teacher_cfg: TeacherConfig) -> str:
    """The name recorded in the cache: the configured path (``builtin:tiny`` stays symbolic)."""
    p = teacher_cfg.path
    return p if p.startswith("builtin:") or not Path(p).exists() else str(Path(p).resolve())

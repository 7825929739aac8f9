"""Extraction's config sections: ``[teacher]``, ``[data]``, ``[regenerate]`` and ``[extract]``.

Torch-free (pydantic only), so that :mod:`dflash_cache.runtime.schema` can compose them with the other
stages' sections without loading a stage. The checks between these sections are :func:`check_sections`;
the one check against another stage's section (bucket edges below ``data.max_length``) is the composer's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic_core import InitErrorDetails

from dflash_cache.runtime.section import Section, field_error


class TeacherConfig(Section):
    """The target model whose hidden states the drafter learns from (extraction, regeneration, live eval)."""

    path: str = "builtin:tiny"
    """A local HF model directory, a hub id, or a tiny teacher built locally on first use: `builtin:tiny`
    (Qwen3), `builtin:tiny-qwen3_5` (hybrid Gated DeltaNet), `builtin:tiny-qwen3_moe`, `builtin:tiny-llama`.
    A hub id is looked up in the local HF cache first; see docs/troubleshooting.md for offline machines."""
    revision: str | None = None
    """Hub revision (commit or tag) to load; recorded in the cache spec."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the teacher's weights and of the features it writes."""
    trust_remote_code: bool = False
    """Allow model code from the model repository (only when you ask for it)."""
    device: str = "auto"
    """`auto` = `cuda:LOCAL_RANK` when CUDA is available, else `cpu`."""
    device_map: str | None = None
    """E.g. `auto` to split a teacher too big for one GPU over this process's GPU group."""
    attn_implementation: str | None = None
    """Passed to `from_pretrained` (e.g. `sdpa`, `flash_attention_2`)."""
    hidden_size: int | None = Field(None, gt=0)
    """The teacher's hidden size, for `dflash-train estimate` on a machine without its weights or the hub (the
    cache's spec, or the model's config.json when present, takes precedence); extraction checks it."""
    vocab_size: int | None = Field(None, gt=0)
    """The teacher's vocabulary size, likewise."""
    num_layers: int | None = Field(None, gt=0)
    """The teacher's decoder layers, likewise."""



class DataConfig(Section):
    """The conversations to extract (and to regenerate answers for)."""

    path: str = "builtin:tiny-chat"
    """JSONL or JSON array file (ShareGPT as distributed; told apart by content, read as a stream) / Parquet /
    saved HF dataset directory (or a directory of those), or `builtin:tiny-chat`; `--data` overrides it."""
    max_length: int = Field(3072, gt=1)
    """Tokens per sample after templating; longer samples are truncated (counted). In-process `regenerate`
    stops a conversation at a prompt this long (counted)."""
    min_loss_tokens: int | None = Field(None, ge=1)
    """Samples with fewer loss (assistant) tokens are dropped (counted); unset: 2 x `model.block_size`."""
    skip_bad: bool = False
    """Malformed records become counted skips instead of errors (`--skip-bad`)."""
    system_prompt: str | None = None
    """System turn added to conversations that have none."""
    enable_thinking: bool | None = None
    """Passed to chat templates that take it (Qwen3's thinking switch)."""



class RegenerateConfig(Section):
    """`dflash-extract regenerate`: the teacher answers the prompts itself (in-process or via a server)."""

    max_new_tokens: int = Field(512, gt=0)
    """Longest generated reply (`max_tokens` on an endpoint)."""
    batch_size: int = Field(8, gt=0)
    """Prompts per `generate` call (left-padded; in-process only)."""
    window: int = Field(1024, gt=0)
    """In-process: conversations regenerated together, all their rounds, before they are written and the next
    ones are read (memory grows with it, not with the input; each round's batches are drawn from it, so keep it
    many times `batch_size`)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 = greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling when temperature > 0."""
    seed: int = 0
    """Sampling seed (in-process: per batch; endpoint: per conversation and turn)."""
    stop: list[str] = Field(default_factory=list)
    """A reply ends before the first of these strings (not included), in both the in-process and endpoint
    paths."""
    endpoint: str | None = None
    """Base URL of an OpenAI-compatible server (vllm serve, SGLang), e.g. `http://host:8000` (a trailing /v1 is
    accepted); unset: generate in this process with HF generate. The CLI's `--endpoint` sets it."""
    served_model: str | None = None
    """The served model to request, vouching that a model served under another name is the teacher
    (`--served-model`); unset: the one of the server's /v1/models whose name is `teacher.path` (or ends with
    the same last path component), an error if none is."""
    max_concurrency: int = Field(64, gt=0)
    """Endpoint requests in flight (one per conversation)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Seconds without a byte from the server before a retry."""
    max_retries: int = Field(6, ge=0)
    """Retries of a request after 429/5xx/timeouts/lost connections."""
    retry_backoff_s: float = Field(1.0, gt=0)
    """First wait before a retry; doubles each time (capped at 60 s)."""
    max_consecutive_failures: int = Field(50, gt=0)
    """Stop the run when this many conversations in a row failed (server down or misconfigured)."""
    fsync_every_s: float = Field(5.0, ge=0)
    """Fsync the output at most this often (and at the end): a killed process never loses written answers,
    a machine crash loses at most this many seconds of them."""
    api_key_env: str | None = None
    """Environment variable holding the server's API key (sent as Bearer)."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra fields merged into every request body (engine-specific sampling, e.g. `{top_k = 20, min_p = 0}`)."""



class ExtractConfig(Section):
    """`dflash-extract`: teacher batches, work units and the background writers."""

    tokens_per_batch: int = Field(8192, gt=0)
    """Token budget of one teacher forward (rows x padded length); at least `data.max_length`."""
    max_batch_size: int = Field(64, gt=0)
    """Most rows in one teacher forward."""
    unit_size: int = Field(256, gt=0)
    """Samples per work unit (the resume granularity)."""
    max_inflight_bytes: int = Field(2 << 30, gt=0)
    """Bytes of features between the device->host copy and the written part, at most (the teacher waits
    beyond it)."""
    writer_threads: int = Field(2, gt=0)
    """Background threads compressing and writing parts."""
    on_nonfinite: Literal["skip", "error"] = "skip"
    """A sample with NaN/Inf features: `skip` (counted) or `error`."""
    lease_timeout_s: float | None = Field(None, gt=0)
    """A part leased by a writer on another host is taken over when that writer's heartbeat (written every
    30 s) is older than this; at least 3 heartbeats (90 s), so that a live writer never loses its part to a
    late heartbeat; unset: 20 heartbeats (600 s). `dflash-cache release CACHE --host NAME` takes a dead host's
    parts over at once."""
    batch_overhead: float = Field(0.02, ge=0)
    """Batch planning: each extra batch costs this fraction of `tokens_per_batch` (less padding vs fewer
    batches)."""




def check_sections(data: DataConfig, extract: ExtractConfig) -> list[InitErrorDetails]:
    """Checks across extraction's sections, each reported at the field to change."""
    errors = []
    if extract.tokens_per_batch < data.max_length:
        errors.append(field_error(
            ("extract", "tokens_per_batch"), extract.tokens_per_batch,
            f"is below data.max_length ({data.max_length}): a sample of max_length tokens would not fit in a "
            "batch; set it to at least data.max_length"))
    from dflash_cache.lease import HEARTBEAT_S, LEASE_TIMEOUT_MIN_S

    if extract.lease_timeout_s is not None and extract.lease_timeout_s < LEASE_TIMEOUT_MIN_S:
        errors.append(field_error(
            ("extract", "lease_timeout_s"), extract.lease_timeout_s,
            f"is below {LEASE_TIMEOUT_MIN_S:.0f} s: writers refresh their leases every {HEARTBEAT_S:.0f} s, so a "
            "shorter timeout takes parts away from live writers whose heartbeat is merely late; set at least "
            f"{LEASE_TIMEOUT_MIN_S:.0f}, or use `dflash-cache release CACHE --host NAME` for a host known dead"))
    return errors

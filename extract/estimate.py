"""``dflash-extract estimate CONFIG``: sample and token counts after templating, and the projected cache
size per codec, without loading the teacher's weights."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_cache.buckets import bucket_of
from dflash_cache.errors import UsageError
from dflash_cache.runtime.schema import PipelineConfig

from .cli_args import DEFAULT_TOKENS_PER_S, load_run_config
from .cli_args import estimate_parser as build_parser
from .data import ReadCounts, iter_records
from .progress import human_bytes
from .run_config import sample_rules
from .teacher import (
    kernel_hint,
    load_teacher_config,
    load_tokenizer,
    missing_kernels,
    resolve_layer_ids,
    resolve_mask_token,
)
from .template import TokenizeStats

# Stored bytes per raw bf16 byte of features (measured on activations with outlier channels);
# fp8 adds one fp32 scale per token per layer.
CODEC_RATIO = {"bf16-raw": 1.0, "bf16-zstd": 0.69, "bf16-lz4": 0.80, "fp8-e4m3": 0.5 * 0.87}
SMALL_BYTES_PER_TOKEN = 5  # input_ids (int32) + loss_mask (bool), before compression
# Decoded GB/s of features (bf16 bytes delivered) per reader core through the loader, every codec measured side
# by side: bench/bench_decode_rates.py (27B width, 1 reader, median of 3 interleaved rounds, docs/performance.md);
# override with --decode-gbps after measuring on the training host.
DECODE_GBPS_PER_CORE = {"bf16-raw": 3.2, "bf16-zstd": 1.06, "bf16-lz4": 2.0, "fp8-e4m3": 0.26}


@dataclass
class Estimate:
    stats: TokenizeStats
    n_records: int
    hidden_size: int
    layer_ids: list[int]
    bucket_samples: list[int]
    bucket_tokens: list[int]
    bytes_per_codec: dict[str, int] = field(default_factory=dict)
    mask_token: tuple[int, str] = (0, "")  # (id, source) recorded in the cache
    kernel_note: str = ""  # optional GPU kernels the teacher would use and that are missing
    bytes_with_final: dict[str, int] = field(default_factory=dict)  # plus the final hidden state (width H)
    tokens_per_s: float = DEFAULT_TOKENS_PER_S  # training speed the read bandwidth is sized for
    decode_gbps: dict[str, float] = field(default_factory=lambda: dict(DECODE_GBPS_PER_CORE))
    final_hidden: bool = False  # cache.store_final_hidden: one more H-wide slot per token
    read: ReadCounts = field(default_factory=ReadCounts)  # what reading the data counted

    @property
    def slots(self) -> int:
        return len(self.layer_ids) + int(self.final_hidden)

    def lines(self, codec: str) -> list[str]:
        s = self.stats
        out = [
            self.read.summary(),
            f"records: {self.n_records}; kept {s.n_samples} samples, {s.n_tokens} tokens "
            f"({s.n_loss_tokens} loss tokens)",
            f"skipped: {s.n_bad} bad ({len(self.read.bad)} when read, {s.n_bad - len(self.read.bad)} when "
            f"tokenized), {s.n_too_few_loss} with too few loss tokens; truncated to max_length: {s.n_truncated}",
            f"features: layers {self.layer_ids} x hidden {self.hidden_size} = "
            f"{len(self.layer_ids) * self.hidden_size} values per token"
            + (f", + the final normed state ({self.hidden_size}) = {self.slots * self.hidden_size}"
               if self.final_hidden else ""),
            f"mask token: {self.mask_token[0]} (from the {self.mask_token[1]})",
            "buckets: " + ", ".join(f"{b}: {n} samples / {t} tokens"
                                    for b, (n, t) in enumerate(zip(self.bucket_samples, self.bucket_tokens, strict=True))),
            "projected cache size:",
        ]
        out[-1] = (f"projected cache size (without / with the final hidden state), and reading it at "
                   f"{self.tokens_per_s:,.0f} tokens/s:")
        n_tok = max(self.stats.n_tokens, 1)
        raw_per_token = (len(self.layer_ids)) * self.hidden_size * 2
        for name, n in self.bytes_per_codec.items():
            final = self.bytes_with_final.get(name, n)
            bw = self.tokens_per_s * n / n_tok  # stored bytes per second
            bw_final = self.tokens_per_s * final / n_tok
            cores = self.tokens_per_s * raw_per_token / (self.decode_gbps[name] * 1e9)
            cores_final = cores * (len(self.layer_ids) + 1) / len(self.layer_ids)
            out.append(f"  {name:10s} {human_bytes(n):>10s} / {human_bytes(final):>10s}   read "
                       f"{human_bytes(bw)}/s / {human_bytes(bw_final)}/s   reader cores {cores:.3g} / {cores_final:.3g}"
                       f"{'   <- configured' if name == codec else ''}")
        out.append(f"  (reader cores at {', '.join(f'{k} {v:g}' for k, v in self.decode_gbps.items())} GB/s "
                   "decoded per core; see docs/sizing.md)")
        if self.kernel_note:
            out.append(f"note: {self.kernel_note} (extraction time on GPU depends on it)")
        return out


def projected_bytes(n_tokens: int, n_layers: int, hidden: int) -> dict[str, int]:
    """Stored bytes per codec; ``n_layers`` counts H-wide slots (the final normed state is one more)."""
    raw = n_tokens * n_layers * hidden * 2
    out = {}
    for codec, ratio in CODEC_RATIO.items():
        extra = n_tokens * n_layers * 4 if codec == "fp8-e4m3" else 0
        out[codec] = int(raw * ratio + extra + n_tokens * SMALL_BYTES_PER_TOKEN)
    return out


def estimate(cfg: PipelineConfig, tokens_per_s: float = DEFAULT_TOKENS_PER_S,
             decode_gbps: dict[str, float] | None = None) -> Estimate:
    """Tokenize the whole data set and project the cache size (no teacher forward, no weights)."""
    tokenizer = load_tokenizer(cfg.teacher)
    text_cfg = load_teacher_config(cfg.teacher)
    layer_ids = resolve_layer_ids(cfg.cache, int(text_cfg.num_hidden_layers))
    mask_token = resolve_mask_token(cfg.mask_token_id, tokenizer, int(text_cfg.vocab_size))
    counts = ReadCounts()
    records = iter_records(cfg.data.path, cfg.data.skip_bad, counts)  # a stream: memory flat in the data size
    stats = TokenizeStats()
    n_buckets = len(cfg.cache.bucket_edges) + 1
    bs, bt = [0] * n_buckets, [0] * n_buckets
    for s in sample_rules(cfg).iter(records, tokenizer, stats):
        b = bucket_of(cfg.cache.bucket_edges, cfg.data.max_length, s.length)
        bs[b] += 1
        bt[b] += s.length
    stats.n_bad += len(counts.bad)
    hidden = int(text_cfg.hidden_size)
    return Estimate(stats, counts.n_total, hidden, layer_ids, bs, bt,
                    projected_bytes(stats.n_tokens, len(layer_ids) + int(cfg.cache.store_final_hidden), hidden),
                    mask_token, kernel_hint(missing_kernels(text_cfg)),
                    bytes_with_final=projected_bytes(stats.n_tokens, len(layer_ids) + 1, hidden),
                    tokens_per_s=tokens_per_s, decode_gbps={**DECODE_GBPS_PER_CORE, **(decode_gbps or {})},
                    final_hidden=cfg.cache.store_final_hidden, read=counts)


def _decode_rates(items: Sequence[str]) -> dict[str, float]:
    out = {}
    for item in items:
        codec, _, value = item.partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if codec not in CODEC_RATIO or rate <= 0:
            raise UsageError(f"--decode-gbps {item!r}: expected CODEC=GBPS with CODEC one of {list(CODEC_RATIO)} and a "
                             "positive rate, e.g. bf16-zstd=1.1")
        out[codec] = rate
    return out


def cli_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    cfg = load_run_config(args.config, args.set, args.data, args.skip_bad)
    est = estimate(cfg, args.tokens_per_s, _decode_rates(args.decode_gbps))
    for line in est.lines(cfg.cache.codec):
        print(line)
    return 0

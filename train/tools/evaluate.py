"""``dflash-train eval CONFIG --cache CACHE --checkpoint CKPT_OR_RUN_DIR [--json] [--live]``.

Two measurements of the same quantity, the acceptance length tau (tokens per target forward):

* **teacher-forced** (:func:`teacher_forced_eval`): over the held-out samples of the cache (those the
  training plan leaves out: id hash below ``loader.holdout_fraction``), every eligible anchor, greedy
  drafts; tau = 1 + mean number of leading drafted tokens equal to the data, per-position accuracy.
  A block near the end of a sample cannot be accepted past it, so tau is capped there.
* **live** (:func:`live_eval`): real greedy speculative decoding with the teacher, on prompts taken from
  the same held-out samples (:func:`live_prompts`: each sample's tokens before its first loss token,
  i.e. the conversation up to the first assistant turn's generation prompt). Each cycle the drafter
  proposes B-1 tokens from the teacher's captured features of the accepted context, the teacher
  verifies the block in one forward, the longest matching prefix plus the teacher's own next token is
  kept. The output must equal the teacher's plain greedy decoding token for token (any difference is
  an error: the decoding is lossless).

Live tau follows the DFlash reference's convention (z-lab/dflash 44947fb, :data:`TAU_CONVENTION`): a cycle's
count is the drafts it kept + 1, never cut by the token budget or a stop token (the output is cut, the count
is not); cycles run until more than ``max_new_tokens`` tokens exist or a stop token appears, the first one
always; a prompt's tau is the mean over its cycles and the overall tau the mean over prompts. The ``dflash``
0.1.0 package, whose benchmark the published model cards quote, counts otherwise (:data:`CARD_TAU_CONVENTION`,
:func:`card_cycles`): ``--card-tau`` reports that figure too, from the same cycles.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflash_cache.errors import CacheCorruptError, ConfigError, DFlashError
from dflash_cache.protocols import ReadableCache
from dflash_cache.runtime.threads import budget_cpu_threads
from extract.config import TeacherConfig
from train.config import EvalConfig

from ..cli_args import eval_parser as build_parser
from ..models.attention import BlockLayout
from ..models.objective import FlatBatch, all_anchors, block_metrics, merge_metrics, predict_blocks
from ..protocols import Drafter
from .sampling import RejectionSampler, SamplingParams, warp

log = logging.getLogger(__name__)


TAU_CONVENTION = (
    "live tau = mean over prompts of the prompt's mean accepted tokens per draft-verify cycle; a cycle counts "
    "the drafts it kept + 1 (the teacher's own token) in full, also the last one, whose tokens past the budget "
    "or a stop token are dropped from the output; cycles run until more than max_new_tokens tokens exist or a "
    "stop token appears (the DFlash reference's dflash_generate + benchmark convention, z-lab/dflash 44947fb; "
    "spec_generate of the exported dflash.py counts the same)"
)


CARD_TAU_CONVENTION = (
    "card tau = the dflash 0.1.0 package's dflash_generate + benchmark convention (the published model cards'): "
    "a cycle counts the tokens it adds to the output, the last one clipped at the budget and after the first stop "
    "token; cycles run while fewer than max_new_tokens tokens exist (a prompt whose first token stops has none and "
    "is left out of the mean); replayed from the same cycles as tau (the package drafts its last cycle with a "
    "block cut to the budget, which can accept fewer there)"
)


def card_cycles(accepted_per_cycle: Sequence[int], generated: Sequence[int], max_new_tokens: int,
                eos: set[int]) -> list[int]:
    """The cycle counts of :data:`CARD_TAU_CONVENTION` from a run's full counts and its ``generated`` tokens (the
    first being the prefill's). Each cycle adds its tokens after the ``have`` tokens so far, at most the budget's
    remainder, up to and including the first stop token; none runs once the budget is reached or a stop seen."""
    out: list[int] = []
    have = 1
    if not generated or generated[0] in eos:
        return out
    for n in accepted_per_cycle:
        if have >= max_new_tokens:
            break
        produced = min(n, max_new_tokens - have)
        stop = next((i + 1 for i, t in enumerate(generated[have:have + produced]) if t in eos), None)
        out.append(stop or produced)
        have += stop or produced
        if stop:
            break
    return out


class LosslessnessError(DFlashError):
    """Speculative decoding produced something other than the teacher's greedy output."""

    exit_code = 3


# ----------------------------------------------------------------------------------------------
# Teacher-forced acceptance on held-out cache samples
# ----------------------------------------------------------------------------------------------


@dataclass
class TeacherForcedResult:
    acceptance_length: float
    per_position_accuracy: list[float]
    n_blocks: int
    n_samples: int


def holdout_sample_ids(cache: ReadableCache, fraction: float, skip_corrupt: bool = False) -> np.ndarray:
    """The cache's held-out sample ids (the same rule the training plan uses to leave them out). With
    ``skip_corrupt`` (``loader.on_corrupt=skip``) parts whose commit record or small arrays cannot be
    trusted are left out, as the loader leaves them out."""
    from ..data.plan import holdout_mask

    ids = np.asarray(cache.index(skip_corrupt=skip_corrupt).sample_ids, dtype=np.int64)
    return np.sort(ids[holdout_mask(ids, fraction)])


def _sample_batch(sample: Any, device: torch.device) -> SimpleNamespace:
    """One cache sample as a one-row batch (a single document, positions from 0)."""
    T = int(sample.input_ids.shape[0])
    return SimpleNamespace(
        features=sample.features.unsqueeze(0).to(device),  # [1, T, n*H]
        input_ids=torch.as_tensor(sample.input_ids, dtype=torch.long).unsqueeze(0).to(device),
        loss_mask=torch.as_tensor(sample.loss_mask, dtype=torch.bool).unsqueeze(0).to(device),
        doc_ids=torch.zeros(1, T, dtype=torch.int32, device=device),
        position_ids=torch.arange(T, device=device).unsqueeze(0),
        seed=0,
    )


@torch.no_grad()
def sample_metrics(model: Drafter, batch: Any, anchors_per_forward: int = 256) -> dict[str, Tensor] | None:
    """Greedy metrics of every eligible anchor of a batch, in forwards of at most ``anchors_per_forward``."""
    flat = FlatBatch.of(batch)
    anchors = all_anchors(flat.eligible)  # [A]
    total = None
    for s in range(0, anchors.shape[0], anchors_per_forward):
        pred, blocks = predict_blocks(model, batch, flat, anchors[s:s + anchors_per_forward])  # [n, B]
        total = merge_metrics(total, block_metrics(pred, blocks))
    return total


def _read_eval_samples(cache: ReadableCache, ids: list[int], skip_corrupt: bool) -> list[Any]:
    """``cache.read_samples(ids)``; with ``skip_corrupt`` the samples of a part that fails a check are
    left out (logged), as the loader quarantines it."""
    try:
        return cache.read_samples(ids)
    except CacheCorruptError:
        if not skip_corrupt:
            raise
    out = []
    for i in ids:
        try:
            out += cache.read_samples([i])
        except CacheCorruptError as err:
            log.warning("held-out evaluation leaves out sample %d (loader.on_corrupt = skip): %s", i, err)
    return out


def teacher_forced_eval(model: Drafter, cache: ReadableCache, sample_ids: Sequence[int], *, max_blocks: int | None = None,
                        read_batch: int = 16, skip_corrupt: bool = False) -> TeacherForcedResult:
    """Teacher-forced acceptance of ``model`` over ``sample_ids`` of ``cache`` (every eligible anchor).
    ``skip_corrupt``: leave out samples whose part fails a check instead of raising."""
    if len(sample_ids) == 0:
        raise ConfigError(
            "no samples to evaluate: the cache has no held-out samples at loader.holdout_fraction; "
            "raise loader.holdout_fraction (before training) or pass --samples all"
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, n_samples = None, 0
    try:
        for s in range(0, len(sample_ids), read_batch):
            for sample in _read_eval_samples(cache, [int(i) for i in sample_ids[s:s + read_batch]], skip_corrupt):
                m = sample_metrics(model, _sample_batch(sample, device))
                n_samples += 1
                if m is not None:
                    total = merge_metrics(total, m)
                if max_blocks and total is not None and int(total["n_blocks"]) >= max_blocks:
                    break
            if max_blocks and total is not None and int(total["n_blocks"]) >= max_blocks:
                break
    finally:
        model.train(was_training)
    if total is None:
        B = model.config.block_size
        return TeacherForcedResult(float("nan"), [float("nan")] * (B - 1), 0, n_samples)
    return TeacherForcedResult(float(total["acceptance_length"]), [float(x) for x in total["accuracy_per_position"]],
                               int(total["n_blocks"]), n_samples)


# ----------------------------------------------------------------------------------------------
# Live speculative decoding with the teacher
# ----------------------------------------------------------------------------------------------


@dataclass
class LivePromptResult:
    prompt_tokens: int
    generated: list[int]  # cut at max_new_tokens and after the first stop token
    accepted_per_cycle: list[int]  # per teacher verification: drafts kept + 1, never cut (TAU_CONVENTION)
    sample_id: int | None = None  # the cache sample the prompt came from

    @property
    def tau(self) -> float:
        return sum(self.accepted_per_cycle) / max(1, len(self.accepted_per_cycle))


@dataclass
class LiveResult:
    prompts: list[LivePromptResult] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean of the per-prompt taus (as the reference benchmark averages)."""
        return sum(p.tau for p in self.prompts) / max(1, len(self.prompts))


def live_prompts(cache: ReadableCache, sample_ids: Sequence[int], n: int) -> tuple[list[tuple[int, list[int]]], int]:
    """Up to ``n`` prompts from ``sample_ids`` (in order), as ``(sample id, token ids)``: each sample's
    tokens before its first loss token, i.e. the conversation up to the first assistant turn's
    generation prompt, as the teacher saw it at extraction. Reads no features. Returns the prompts and
    the number of samples passed over (no token before the first loss token)."""
    prompts: list[tuple[int, list[int]]] = []
    skipped, at = 0, 0
    while len(prompts) < n and at < len(sample_ids):
        chunk = [int(i) for i in sample_ids[at:at + n - len(prompts)]]
        at += len(chunk)
        for sid, (ids, mask) in zip(chunk, cache.read_token_ids(chunk), strict=True):
            first = int(mask.argmax()) if mask.any() else 0
            if first == 0:
                skipped += 1
                continue
            prompts.append((sid, ids[:first].tolist()))
    return prompts, skipped


def _teacher_step(teacher: Any, ids: list[int], layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Full teacher forward over ``ids``: (features [T, n*H], greedy next token per position [T])."""
    from extract.teacher import capture_features, teacher_device

    x = torch.tensor([ids], dtype=torch.long, device=teacher_device(teacher))
    feats, logits = capture_features(teacher, x, None, layer_ids, with_logits=True)
    return feats[0], logits[0].argmax(-1)


@torch.no_grad()
def greedy_reference(teacher: Any, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The teacher's own greedy continuation (full forward per token, like the verifier)."""
    from extract.teacher import teacher_device

    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = teacher(input_ids=torch.tensor([ids], device=teacher_device(teacher)), use_cache=False).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in eos:
            break
    return out


@torch.no_grad()
def propose(model: Drafter, ctx_features: Tensor, last_token: int) -> list[int]:
    """Greedy block draft: B-1 tokens after ``last_token`` (not yet seen by the teacher), given the
    teacher features of the P tokens before it. ctx_features [P, n*H]. DFlash2: the selector's walk."""
    if hasattr(model, "select_path"):  # DFlash2: the selector walks the block from the anchor
        return model.select_path(draft_hidden(model, ctx_features, last_token), last_token).tolist()
    return draft_logits(model, ctx_features, last_token).argmax(-1).tolist()  # [B-1]


@torch.no_grad()
def draft_logits(model: Drafter, ctx_features: Tensor, last_token: int) -> Tensor:
    """The drafter's unary logits [B-1, V] for the B-1 tokens after ``last_token``. ctx_features [P, n*H]."""
    return model.logits(draft_hidden(model, ctx_features, last_token))


@torch.no_grad()
def draft_hidden(model: Drafter, ctx_features: Tensor, last_token: int) -> Tensor:
    """The drafter's final hidden states [B-1, H] of the block rows after ``last_token``. ctx_features [P, n*H]."""
    cfg = model.config
    B, P = cfg.block_size, int(ctx_features.shape[0])
    device = next(model.parameters()).device
    block = torch.full((1, B), cfg.mask_token_id, dtype=torch.long, device=device)
    block[0, 0] = last_token
    # the context: P positions of one document plus the anchor slot P (never visible: strictly before it)
    positions = torch.arange(P + 1, device=device)
    layout = BlockLayout(anchors=torch.tensor([P], device=device), ctx_doc=torch.zeros(P + 1, dtype=torch.long,
                         device=device), ctx_pos=positions, block_size=B)
    features = torch.cat([ctx_features.to(device), ctx_features.new_zeros(1, ctx_features.shape[1]).to(device)])
    hidden = model(features.unsqueeze(0), block, (P + torch.arange(B, device=device)).unsqueeze(0), layout)
    return hidden[0, 1:]  # [B-1, H]


@torch.no_grad()
def speculative_decode(model: Drafter, teacher: Any, prompt: list[int], max_new_tokens: int, eos: set[int],
                       layer_ids: Sequence[int]) -> LivePromptResult:
    """Greedy speculative decoding; the teacher verifies each drafted block in one forward. Cycles are
    run and counted as :data:`TAU_CONVENTION` says."""
    feats, nxt = _teacher_step(teacher, prompt, layer_ids)  # prefill
    seq, pending = list(prompt), int(nxt[-1])  # seq: tokens the teacher has features for
    generated, cycles = [pending], []
    stopped = pending in eos
    while True:
        drafts = propose(model, feats, pending)
        feats_v, post = _teacher_step(teacher, seq + [pending] + drafts, layer_ids)
        P = len(seq)
        verdict = post[P:].tolist()  # teacher's token after pending, after each draft
        n = 0
        while n < len(drafts) and drafts[n] == verdict[n]:
            n += 1
        new = drafts[:n] + [verdict[n]]
        cycles.append(len(new))
        seq = seq + [pending] + new[:-1]
        feats = feats_v[: len(seq)]
        generated.extend(new)
        pending = new[-1]
        stopped = stopped or any(t in eos for t in new)
        if stopped or len(generated) > max_new_tokens:
            break
    stop = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
    return LivePromptResult(len(prompt), generated[:min(stop, max_new_tokens)], cycles)


# -- sampled verification (temperature > 0): lossless in distribution ----------------------------------


def _teacher_logits_step(teacher: Any, ids: list[int], layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Full teacher forward over ``ids``: (features [T, n*H], next-token logits per position [T, V])."""
    from extract.teacher import capture_features, teacher_device

    x = torch.tensor([ids], dtype=torch.long, device=teacher_device(teacher))
    feats, logits = capture_features(teacher, x, None, layer_ids, with_logits=True)
    return feats[0], logits[0]


# (model, accepted tokens [P], their teacher features [P, n*H], last token, params, sampler) -> (drafts, q)
Proposal = Callable[[Any, list[int], Tensor, int, SamplingParams, RejectionSampler], tuple[list[int], Tensor]]


def sample_proposal(model: Drafter, ctx_tokens: list[int], ctx_features: Tensor, last_token: int,
                    params: SamplingParams, sampler: RejectionSampler) -> tuple[list[int], Tensor]:
    """The DFlash proposal: each of the B-1 block rows drawn from the drafter's warped distribution.
    Returns (drafts [B-1], their proposal distributions q [B-1, V]); another proposal (e.g. a candidate
    selector's, which may condition each draft on the previous one) plugs in with the same signature."""
    q = warp(draft_logits(model, ctx_features, last_token), params).cpu()  # [B-1, V]
    return [sampler.sample(row) for row in q], q


def selector_proposal(model: Drafter, ctx_tokens: list[int], ctx_features: Tensor, last_token: int,
                      params: SamplingParams, sampler: RejectionSampler) -> tuple[list[int], Tensor]:
    """The DFlash2 proposal: the selector's walk, each row drawn from softmax(scores / T) over its K candidates
    given the token drawn for the row before (the anchor for the first). q [B-1, V] is that distribution on the
    vocabulary (zero outside the row's candidates): exactly what each draft was drawn from, so rejection
    sampling stays lossless. ``params``' top-p / top-k shape the teacher's side only."""
    hidden = draft_hidden(model, ctx_features, last_token)  # [B-1, H]
    vocab = int(model.config.vocab_size)
    rows: list[Tensor] = []

    def draw(scores: Tensor, cand: Tensor) -> Tensor:  # scores [1, K], cand [K] -> the drawn column [1]
        q = torch.zeros(vocab).index_put_((cand.cpu(),), torch.softmax(scores[0].float() / params.temperature, -1).cpu())
        rows.append(q)
        return (cand == sampler.sample(q)).nonzero()[0]

    drafts = model.walk(hidden, last_token, draw).tolist()
    return drafts, torch.stack(rows)


@torch.no_grad()
def sampled_speculative_decode(model: Drafter, teacher: Any, prompt: list[int], max_new_tokens: int, eos: set[int],
                               layer_ids: Sequence[int], params: SamplingParams, sampler: RejectionSampler,
                               proposal: Proposal = sample_proposal) -> LivePromptResult:
    """Speculative sampling (train/tools/sampling.py): the output is distributed as the teacher's own sampling with
    ``params``. Cycles are run and counted as :data:`TAU_CONVENTION` says."""
    feats, logits = _teacher_logits_step(teacher, prompt, layer_ids)  # prefill
    seq, pending = list(prompt), sampler.sample(warp(logits[-1], params))
    generated, cycles = [pending], []
    stopped = pending in eos
    while True:
        drafts, q = proposal(model, seq, feats, pending, params, sampler)
        feats_v, logits_v = _teacher_logits_step(teacher, seq + [pending] + drafts, layer_ids)
        P = len(seq)
        new = sampler.verify(drafts, q, warp(logits_v[P:], params))  # p [k+1, V]
        cycles.append(len(new))
        seq = seq + [pending] + new[:-1]
        feats = feats_v[: len(seq)]
        generated.extend(new)
        pending = new[-1]
        stopped = stopped or any(t in eos for t in new)
        if stopped or len(generated) > max_new_tokens:
            break
    stop = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
    return LivePromptResult(len(prompt), generated[:min(stop, max_new_tokens)], cycles)


def live_eval(model: Drafter, teacher: Any, prompts: Sequence[list[int]], *, max_new_tokens: int, eos: set[int],
              layer_ids: Sequence[int], sample_ids: Sequence[int] | None = None,
              sampling: SamplingParams | None = None, seed: int = 0) -> LiveResult:
    """Speculative decoding on every prompt. Greedy (``sampling`` None or temperature 0): checked token for
    token against the teacher's greedy output. Sampled: speculative sampling (lossless in distribution, which
    tests/test_sampling.py checks statistically), drawing from one generator seeded with ``seed``."""
    if max_new_tokens < 1:  # no cycle to count (spec_generate refuses it too)
        raise ConfigError(f"live decoding: max_new_tokens must be >= 1, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    result = LiveResult()
    sampler = RejectionSampler(torch.Generator().manual_seed(seed))
    try:
        for i, prompt in enumerate(prompts):
            if sampling is not None and not sampling.greedy:
                got = sampled_speculative_decode(
                    model, teacher, prompt, max_new_tokens, eos, layer_ids, sampling, sampler,
                    selector_proposal if hasattr(model, "walk") else sample_proposal)
                got.sample_id = None if sample_ids is None else int(sample_ids[i])
                result.prompts.append(got)
                log.info("live prompt %d: %d tokens, tau %.3f (T=%g)", i, len(got.generated), got.tau,
                         sampling.temperature)
                continue
            got = speculative_decode(model, teacher, prompt, max_new_tokens, eos, layer_ids)
            got.sample_id = None if sample_ids is None else int(sample_ids[i])
            want = greedy_reference(teacher, prompt, max_new_tokens, eos)
            if got.generated != want:
                k = next((j for j, (a, b) in enumerate(zip(got.generated, want, strict=False)) if a != b),
                         min(len(got.generated), len(want)))
                raise LosslessnessError(
                    f"prompt {i}: speculative decoding diverged from the teacher's greedy output at generated "
                    f"token {k} (speculative {got.generated[k:k + 5]}, greedy {want[k:k + 5]}); the verifier "
                    "must only keep drafts equal to the teacher's argmax"
                )
            result.prompts.append(got)
            log.info("live prompt %d: %d tokens, tau %.3f", i, len(got.generated), got.tau)
    finally:
        model.train(was_training)
    return result


# ----------------------------------------------------------------------------------------------
# Checkpoint -> drafter
# ----------------------------------------------------------------------------------------------


def load_for_eval(checkpoint: str, cache: ReadableCache, attention: str = "auto", device: torch.device | None = None) -> Any:
    """A drafter from a checkpoint / run dir / drafter dir, checked against ``cache`` (names the field)."""
    from ..models.factory import drafter_class
    from .export import config_for, load_weights

    loaded = load_weights(checkpoint)
    cfg = config_for(loaded, cache.spec)
    if loaded.cache_fingerprint and loaded.cache_fingerprint != cache.spec.fingerprint:
        log.warning("%s was trained on another cache (fingerprint %s, this one %s); evaluating anyway",
                    loaded.source, loaded.cache_fingerprint, cache.spec.fingerprint)
    embed, lm_head = cache.load_head()
    model = drafter_class(cfg)(cfg, embed, lm_head, attention=attention)
    model.load_state_dict({k: v.float() for k, v in loaded.state.items()})
    return model.to(device or torch.device("cpu")).eval()


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def cli_main(argv: Sequence[str] | None = None) -> int:
    from dflash_cache import open_cache
    from dflash_cache.runtime.config import load_config
    from dflash_cache.runtime.schema import TRAIN_COMMAND

    args = build_parser().parse_args(argv)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)  # bad values: exit 2 before any work
    cfg = load_config(args.config, args.overrides, command=TRAIN_COMMAND)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # training's CPU thread budget: torch's default (a thread per core) contends with the cache's readers and
    # other processes, measured 2-5x slower on a busy 2-core machine (bench/bench_eval_threads.py)
    budget_cpu_threads(device, cfg.loader.num_readers)
    cache = open_cache(args.cache)
    model = load_for_eval(args.checkpoint, cache, cfg.model.attention, device)
    ids = (holdout_sample_ids(cache, cfg.loader.holdout_fraction) if args.samples == "holdout"
           else np.sort(np.asarray(cache.index().sample_ids, dtype=np.int64)))
    tf = teacher_forced_eval(model, cache, ids, max_blocks=cfg.eval.max_blocks)
    report: dict[str, Any] = asdict(tf)
    if args.live:
        report["live"] = run_live(model, cfg.eval, cfg.teacher, cache, ids, prompt_source=args.samples,
                                  sampling=sampling, seed=args.seed, card_tau=args.card_tau)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"teacher-forced: tau {tf.acceptance_length:.3f} over {tf.n_blocks} blocks "
              f"({tf.n_samples} samples); accuracy per position "
              + " ".join(f"{a:.3f}" for a in tf.per_position_accuracy))
        if args.live:
            live = report["live"]
            print(f"live: tau {live['tau']:.3f} over {len(live['prompts'])} {args.samples} prompts; per prompt "
                  + " ".join(f"{t:.2f}" for t in live["tau_per_prompt"])
                  + ("; lossless: yes" if live["lossless"] is True else
                     f"; sampled at T={sampling.temperature:g} (top-p {sampling.top_p:g}, top-k {sampling.top_k}): "
                     "lossless in distribution"))
            print(f"  ({TAU_CONVENTION})")
            if args.card_tau:
                print(f"live card tau {live['tau_card']:.3f} over {live['card_prompts']} prompts ({CARD_TAU_CONVENTION})")
    return 0


def run_live(model: Drafter, eval_cfg: EvalConfig, teacher_cfg: TeacherConfig, cache: ReadableCache, sample_ids: Sequence[int],
             prompt_source: str = "holdout", sampling: SamplingParams | None = None, seed: int = 0,
             card_tau: bool = False) -> dict[str, Any]:
    """Live speculative decoding on ``eval.live_prompts`` prompts from ``sample_ids`` (the held-out ones,
    unless the caller says otherwise in ``prompt_source``) with the teacher of ``teacher_cfg``; the ``--json``
    document's ``live`` entry."""
    from extract.teacher import load_teacher

    n = eval_cfg.live_prompts
    prompts, skipped = live_prompts(cache, sample_ids, n)
    if not prompts:
        raise ConfigError(
            f"no prompts for live decoding: eval.live_prompts = {n} and {len(sample_ids)} {prompt_source} "
            f"sample(s) ({skipped} without a prompt before their first assistant turn); with --samples holdout, "
            "raise loader.holdout_fraction before training"
        )
    if len(prompts) < n:
        log.warning("live decoding on %d prompt(s), not eval.live_prompts = %d: only %d %s sample(s) (%d without "
                    "a prompt)", len(prompts), n, len(sample_ids), prompt_source, skipped)
    teacher, tokenizer = load_teacher(teacher_cfg)
    eos = {int(t) for t in np.atleast_1d(teacher.generation_config.eos_token_id or tokenizer.eos_token_id)}
    res = live_eval(model, teacher, [p for _, p in prompts], max_new_tokens=eval_cfg.live_max_new_tokens, eos=eos,
                    layer_ids=list(cache.spec.target_layer_ids), sample_ids=[i for i, _ in prompts],
                    sampling=sampling, seed=seed)
    sampled = sampling is not None and not sampling.greedy
    card = [card_cycles(p.accepted_per_cycle, p.generated, eval_cfg.live_max_new_tokens, eos) for p in res.prompts]
    card_taus = [sum(c) / len(c) for c in card if c]  # the package's benchmark leaves out prompts without a cycle
    extra = {"tau_card": sum(card_taus) / max(1, len(card_taus)), "card_prompts": len(card_taus),
             "tau_card_convention": CARD_TAU_CONVENTION, "card_cycles": card} if card_tau else {}
    return {**extra,
        "tau": res.tau, "tau_convention": TAU_CONVENTION, "prompt_source": prompt_source,
        "tau_per_prompt": [p.tau for p in res.prompts],
        "generated_tokens": [len(p.generated) for p in res.prompts],
        "prompts": [{"sample_id": p.sample_id, "prompt_tokens": p.prompt_tokens, "generated_tokens": len(p.generated),
                     "cycles": len(p.accepted_per_cycle), "tau": p.tau, "accepted_per_cycle": p.accepted_per_cycle}
                    for p in res.prompts],
        # greedy: checked token for token; sampled: speculative sampling, lossless in distribution
        "lossless": "in distribution" if sampled else True,
        "sampling": asdict(sampling) if sampled else None, "seed": seed if sampled else None,
    }

"""Speculative sampling's bonus token: after a block whose drafts were all accepted, the extra token is drawn from
the teacher's distribution at the position after the last draft -- in the rule and in the decoding loop, for
both copies (``train/tools/sampling.py`` with ``eval --live``'s loop, and the shipped ``dflash.py`` with its
``spec_generate``, DFlash and DFlash2 exports).

Both rules are fed blocks that are always accepted (q = p on the drafted rows) and their bonus tokens are
counted against p's last row (chi-square, 2000 draws; a bonus from the last draft's row fails it). The loops
run with a proposal that is the teacher's own sampling (q = p up to rounding), so the first block is accepted
and the bonus token is emitted: through ``eval --live``'s loop, the joint distribution of the first B + 1 tokens
(first token, B - 1 drafts, bonus) must be the teacher's, enumerated exactly at top-k 2 (32 sequences, chi-square
over 2000 decodings); through the shipped ``spec_generate`` (whose forwards cannot be memoized: ~50 ms a
decoding), exactly on each decoding, the rows the loop hands the rule and where the drawn bonus lands."""

from __future__ import annotations

import functools

import pytest
import test_sampling
import torch
from test_sampling import LAYERS, _shipped_module, chi_square_pvalue, exact_distribution

import train.tools.evaluate as ev
from train.tools.sampling import RejectionSampler, SamplingParams, warp

tiny_teacher, prompt, memoized = test_sampling.tiny_teacher, test_sampling.prompt, test_sampling.memoized
DRAWS = 2000
TOP2 = SamplingParams(temperature=1.0, top_k=2)  # 2^(B+1) = 32 sequences of B + 1 tokens at block size 4
BLOCK = 4


# ---- the rule: bonus ~ p[k] ----------------------------------------------------------------------------------


def _rows(seed: int, k: int, vocab: int = 6) -> torch.Tensor:
    """k + 1 distinct full-support distributions [k+1, V]."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)


def _train_bonus(drafts, q, p, gen):
    out = RejectionSampler(gen).verify(drafts.tolist(), q, p)
    return out[-1] if len(out) == len(drafts) + 1 else None


def _shipped_bonus(drafts, q, p, gen):
    accepted, nxt = _shipped_module().speculative_sampling(drafts, q, p, gen)
    return nxt if accepted == len(drafts) else None


def _wrong_row_bonus(drafts, q, p, gen):
    """Wrong: the bonus from the last draft's row p[k-1]."""
    accepted, _ = _shipped_module().speculative_sampling(drafts, q, p, gen)
    return int(torch.multinomial(p[len(drafts) - 1], 1, generator=gen)) if accepted == len(drafts) else None


def bonus_counts(rule, p: torch.Tensor, seed: int) -> dict[tuple, int]:
    """DRAWS blocks of k = len(p) - 1 drafts drawn from q = p[:k] (so all are accepted): counts of the bonus."""
    gen = torch.Generator().manual_seed(seed)
    q = p[:-1].clone()
    counts: dict[tuple, int] = {}
    for _ in range(DRAWS):
        drafts = torch.multinomial(q, 1, generator=gen).view(-1)
        x = rule(drafts, q, p, gen)
        assert x is not None, "a block drafted from q = p was not accepted in full"
        counts[(x,)] = counts.get((x,), 0) + 1
    return counts


@pytest.mark.parametrize("rule", [_train_bonus, _shipped_bonus])
def test_the_bonus_token_of_an_accepted_block_follows_the_row_after_the_last_draft(rule):
    p = _rows(seed=3, k=3)
    want = {(x,): float(p[-1, x]) for x in range(p.shape[1])}
    assert chi_square_pvalue(bonus_counts(rule, p, 5), want, DRAWS) > 1e-3
    # the harness: drawn from the last draft's row instead, the same counts are rejected
    assert chi_square_pvalue(bonus_counts(_wrong_row_bonus, p, 5), want, DRAWS) < 1e-6


# ---- the loops: the (B+1)-th token of a decoding whose first block is accepted ------------------------------


def fixed_proposal(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [1, rows] all token 0, and q [rows, V] one-hot there: a valid proposal (each draft is drawn from
    its q) whose blocks the teacher's forward sees once per prefix (memoized)."""
    q = torch.zeros(rows, vocab)
    q[:, 0] = 1.0
    return torch.zeros(1, rows, dtype=torch.long), q


def teacher_proposal(teacher, params: SamplingParams, prompt_len: int):
    """eval --live's proposal replaced by the teacher's own sampling for the first block: each draft drawn from
    warp(teacher) after the prompt, the anchor and the drafts before it, so q = p and the block is accepted.
    Later blocks (past the observed tokens) use :func:`fixed_proposal`: any proposal keeps the output lossless."""

    def proposal(model, ctx_tokens, ctx_features, last_token, _params, sampler):
        L = model.config.block_size - 1
        if len(ctx_tokens) > prompt_len:
            drafts, q = fixed_proposal(L, model.config.vocab_size)
            return drafts[0].tolist(), q
        prefix, drafts, qs = list(ctx_tokens) + [last_token], [], []
        for _ in range(L):
            q = warp(ev._teacher_logits_step(teacher, prefix + drafts, LAYERS)[1][-1], params)
            drafts.append(sampler.sample(q))
            qs.append(q)
        return drafts, torch.stack(qs)

    return proposal


def test_eval_live_loop_emits_the_bonus_token_from_the_teachers_next_position(tiny_teacher, prompt, memoized):
    """``sampled_speculative_decode``: one loop for DFlash and DFlash2 (their proposals are the only per-family
    part, and the proposal is replaced here)."""
    from test_export_hf import _teacher_drafter

    teacher, _ = tiny_teacher
    model = _teacher_drafter(teacher)
    assert model.config.block_size == BLOCK
    want = exact_distribution(memoized, teacher, prompt, TOP2, BLOCK + 1)
    assert len(want) == 2 ** (BLOCK + 1) and abs(sum(want.values()) - 1) < 1e-5
    sampler = RejectionSampler(torch.Generator().manual_seed(9))
    proposal = teacher_proposal(teacher, TOP2, len(prompt))
    counts: dict[tuple, int] = {}
    for _ in range(DRAWS):
        res = ev.sampled_speculative_decode(model, teacher, prompt, BLOCK + 1, set(), LAYERS, TOP2, sampler, proposal)
        assert res.accepted_per_cycle[0] == BLOCK  # every draft kept, then the bonus
        key = tuple(res.generated)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, want, DRAWS) > 1e-3


@functools.cache
def _teacher_logits(teacher, ids: tuple[int, ...]) -> torch.Tensor:
    return ev._teacher_logits_step(teacher, list(ids), LAYERS)[1][-1]


@pytest.fixture(scope="module")
def shipped_drafters(tiny_teacher, tmp_path_factory):
    from test_export_hf import _export, _load, _teacher_drafter
    from test_sampling_dflash2 import dflash2_from_teacher

    teacher, _ = tiny_teacher
    out = {}
    for arch, model in (("dflash", _teacher_drafter(teacher)), ("dflash2", dflash2_from_teacher(teacher, 1.0))):
        draft = _load(_export(model, tmp_path_factory.mktemp(arch) / "export"))
        assert draft.block_size == BLOCK
        out[arch] = draft
    assert type(out["dflash2"]).__name__ == "DFlash2DraftModel" and type(out["dflash"]).__name__ == "DFlashDraftModel"
    return out


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_shipped_spec_generate_emits_the_bonus_token_from_the_teachers_next_position(tiny_teacher, prompt,
                                                                                     shipped_drafters, monkeypatch,
                                                                                     arch):
    """The exported model's ``spec_generate`` with its ``draft`` replaced by the teacher's own sampling (the
    tokens the target has been fed are recorded by a forward hook), so the first block is accepted in full. The
    rule's statistics are tested above; here, exactly, on every decoding: the loop hands the rule the teacher's
    warped distribution after each prefix of the block (its last row: after the last draft, computed here by a
    plain teacher forward over prompt + block), and the token the rule draws from it is the output's (B+1)-th."""
    import sys

    teacher, _ = tiny_teacher
    draft = shipped_drafters[arch]
    module = sys.modules[type(draft).__module__]  # the file as transformers loaded it from the export
    seen: dict[int, int] = {}  # position -> token the target was fed there
    calls: list[tuple] = []
    real_rule = module.speculative_sampling

    def record(mod, args, kwargs):
        if "position_ids" not in kwargs:  # the test's own teacher forwards (capture_features)
            return
        for pos, tok in zip(kwargs["position_ids"][0].tolist(), kwargs["input_ids"][0].tolist(), strict=True):
            seen[pos] = tok

    def teacher_draft(hidden, anchor_ids, head, temperature, top_p=1.0, top_k=0, generator=None):
        # the anchor sits right after the tokens fed so far (after a rejection this prefix would hold a rejected
        # draft: the proposal would be off, the output still lossless; with q = p there is none)
        prefix = [seen[i] for i in range(len(seen))] + [int(anchor_ids[0])]
        if len(seen) > len(prompt):  # a later block: a fixed proposal (lossless all the same)
            return fixed_proposal(hidden.shape[1], head.weight.shape[0])
        drafts, qs = [], []
        for _ in range(hidden.shape[1]):
            q = module.warp_probs(_teacher_logits(teacher, tuple(prefix + drafts)), temperature, top_p, top_k)
            drafts.append(int(torch.multinomial(q, 1, generator=generator)))
            qs.append(q)
        return torch.tensor([drafts]), torch.stack(qs)

    def rule(drafts, q, p, generator=None):
        accepted, nxt = real_rule(drafts, q, p, generator)
        calls.append((drafts.tolist(), p.clone(), accepted, nxt))
        return accepted, nxt

    monkeypatch.setattr(draft, "draft", teacher_draft)
    monkeypatch.setattr(module, "speculative_sampling", rule)
    ids = torch.tensor([prompt])
    gen = torch.Generator().manual_seed(13)
    hook = teacher.register_forward_pre_hook(record, with_kwargs=True)
    try:
        for _ in range(12):
            seen.clear()
            calls.clear()
            out = draft.spec_generate(teacher, ids, BLOCK + 1, None, 1.0, top_k=TOP2.top_k, generator=gen)
            new = out[0, len(prompt):].tolist()
            drafts, p, accepted, nxt = calls[0]
            assert accepted == BLOCK - 1 and new[1:BLOCK] == drafts  # the first block accepted in full
            for i in range(BLOCK):  # row i: the teacher after the prompt and the block's first i + 1 tokens
                want = warp(_teacher_logits(teacher, tuple(prompt + new[:i + 1])), TOP2)
                torch.testing.assert_close(p[i], want, rtol=1e-4, atol=1e-5)
            assert new[BLOCK] == nxt  # the bonus: drawn from the row after the last draft, emitted after it
    finally:
        hook.remove()

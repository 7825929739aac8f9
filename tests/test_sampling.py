"""Sampled verification (speculative sampling): with the tiny teacher and a fixed prompt, the tokens that
speculative decoding produces are distributed exactly as the teacher's own sampling (chi-square over >= 2000
draws against the exact teacher-only distribution), and the same test fails for wrong acceptance rules."""

from __future__ import annotations

import functools
import hashlib

import pytest
import torch

import train.tools.evaluate as ev
from dflash_cache.errors import ConfigError
from extract.config import TeacherConfig
from train.tools.sampling import RejectionSampler, SamplingParams, warp

DRAWS = 2000
N_TOKENS = 3  # the joint distribution of the first three generated tokens
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny_teacher():
    from extract.teacher import load_teacher
    from extract.tiny import resolve_tiny_teacher

    return load_teacher(TeacherConfig(path=str(resolve_tiny_teacher()), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def prompt(tiny_teacher):
    from extract.builtin_text import builtin_prompts

    _, tok = tiny_teacher
    return tok.apply_chat_template([{"role": "user", "content": builtin_prompts(1)[0]}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


@pytest.fixture
def memoized(monkeypatch):
    """The real teacher and drafter forwards, each computed once per distinct input: a fixed prompt with top-k
    sampling has few distinct prefixes, so thousands of draws cost seconds. The decoding loop, the proposal
    and the verification rule run unchanged."""
    teacher_step, drafter_step = ev._teacher_logits_step, ev.draft_logits
    t_memo: dict = {}
    d_memo: dict = {}

    def teacher(model, ids, layer_ids):
        key = tuple(ids)
        if key not in t_memo:
            t_memo[key] = teacher_step(model, ids, layer_ids)
        return t_memo[key]

    def drafter(model, ctx_features, last_token):
        key = (hashlib.sha1(ctx_features.numpy().tobytes()).hexdigest(), last_token)
        if key not in d_memo:
            d_memo[key] = drafter_step(model, ctx_features, last_token)
        return d_memo[key]

    monkeypatch.setattr(ev, "_teacher_logits_step", teacher)
    monkeypatch.setattr(ev, "draft_logits", drafter)
    return teacher


def _drafter(teacher):
    from test_evaluate import _live_drafter

    return _live_drafter(teacher)


def exact_distribution(teacher_step, teacher, prompt, params: SamplingParams, depth: int) -> dict[tuple, float]:
    """P(x_1..x_depth) of the teacher sampling alone, enumerated over the (top-k) support."""
    out: dict[tuple, float] = {}

    def walk(prefix: list[int], prob: float, toks: tuple) -> None:
        if len(toks) == depth:
            out[toks] = prob
            return
        p = warp(teacher_step(teacher, prefix, LAYERS)[1][-1], params)
        for x in p.nonzero().flatten().tolist():
            walk(prefix + [x], prob * float(p[x]), toks + (x,))

    walk(list(prompt), 1.0, ())
    return out


def chi_square_pvalue(counts: dict[tuple, int], expected_p: dict[tuple, float], n: int) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``expected_p``; cells expecting < 5 draws are pooled;
    a draw outside the teacher's support gives 0."""
    if set(counts) - set(expected_p):
        return 0.0
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell, p in expected_p.items():
        if p * n < 5:
            pool_o, pool_e = pool_o + counts.get(cell, 0), pool_e + p * n
        else:
            obs.append(counts.get(cell, 0))
            exp.append(p * n)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draw(model, teacher, prompt, params, sampler, proposal=ev.sample_proposal) -> tuple[dict, float]:
    """DRAWS decodings of N_TOKENS tokens: (counts of each token tuple, mean drafts accepted per cycle)."""
    counts: dict[tuple, int] = {}
    accepted = []
    for _ in range(DRAWS):
        res = ev.sampled_speculative_decode(model, teacher, prompt, N_TOKENS, set(), LAYERS, params, sampler,
                                            proposal)
        key = tuple(res.generated)
        counts[key] = counts.get(key, 0) + 1
        accepted += [c - 1 for c in res.accepted_per_cycle]
    return counts, sum(accepted) / len(accepted)


def sharper_teacher_proposal(teacher, temperature: float):
    """A proposal overlapping the teacher's distribution without equalling it: each draft drawn in turn from the
    teacher itself at a lower temperature (same top-k), so the verification rule decides what is kept."""

    def proposal(model, ctx_tokens, ctx_features, last_token, params, sampler):
        warped = SamplingParams(temperature, params.top_p, params.top_k)
        prefix, drafts, qs = list(ctx_tokens) + [last_token], [], []
        for _ in range(model.config.block_size - 1):
            q = warp(ev._teacher_logits_step(teacher, prefix + drafts, LAYERS)[1][-1], warped)
            drafts.append(sampler.sample(q))
            qs.append(q)
        return drafts, torch.stack(qs)

    return proposal


class ResidualIsTheTarget(RejectionSampler):
    """Wrong: after a rejection, draw from p instead of norm(max(p - q, 0))."""

    def residual(self, p, q):
        return p


class AcceptWithTargetProbability(RejectionSampler):
    """Wrong: accept a draft with probability p(x), ignoring q."""

    def accept_probability(self, p_x, q_x):
        return p_x


PARAMS = SamplingParams(temperature=1.0, top_k=4)


def test_the_drafter_samples_exactly_the_teachers_distribution(tiny_teacher, prompt, memoized):
    teacher, _ = tiny_teacher
    model = _drafter(teacher)
    want = exact_distribution(memoized, teacher, prompt, PARAMS, N_TOKENS)
    assert len(want) == 4 ** N_TOKENS and abs(sum(want.values()) - 1) < 1e-5
    counts, _ = draw(model, teacher, prompt, PARAMS, RejectionSampler(torch.Generator().manual_seed(1)))
    assert sum(counts.values()) == DRAWS
    assert chi_square_pvalue(counts, want, DRAWS) > 1e-3


def test_the_chi_square_test_catches_wrong_acceptance_rules(tiny_teacher, prompt, memoized):
    """With a proposal that overlaps the teacher, the correct rule passes (drafts are accepted and rejected
    alike) and each wrong rule fails."""
    teacher, _ = tiny_teacher
    model = _drafter(teacher)
    want = exact_distribution(memoized, teacher, prompt, PARAMS, N_TOKENS)
    proposal = sharper_teacher_proposal(teacher, 0.25)
    counts, acc = draw(model, teacher, prompt, PARAMS, RejectionSampler(torch.Generator().manual_seed(2)), proposal)
    assert 0.3 < acc < 2.7  # some drafts kept, some rejected: the rule matters here
    assert chi_square_pvalue(counts, want, DRAWS) > 1e-3
    for wrong in (ResidualIsTheTarget, AcceptWithTargetProbability):
        counts, _ = draw(model, teacher, prompt, PARAMS, wrong(torch.Generator().manual_seed(2)), proposal)
        assert chi_square_pvalue(counts, want, DRAWS) < 1e-6, wrong.__name__


def test_the_chi_square_helper_itself():
    want = {(0,): 0.5, (1,): 0.5}
    assert chi_square_pvalue({(0,): 1000, (1,): 1000}, want, 2000) == pytest.approx(1.0)
    assert chi_square_pvalue({(0,): 1200, (1,): 800}, want, 2000) < 1e-6
    assert chi_square_pvalue({(0,): 1999, (2,): 1}, want, 2000) == 0.0  # a token the teacher never samples


def test_temperature_zero_stays_the_exact_greedy_path(tiny_teacher, prompt):
    teacher, _ = tiny_teacher
    model = _drafter(teacher)
    greedy = ev.live_eval(model, teacher, [prompt], max_new_tokens=8, eos=set(), layer_ids=LAYERS)
    zero = ev.live_eval(model, teacher, [prompt], max_new_tokens=8, eos=set(), layer_ids=LAYERS,
                        sampling=SamplingParams(0.0))
    assert zero.prompts[0].generated == greedy.prompts[0].generated == \
        ev.greedy_reference(teacher, prompt, 8, set())
    sampled = ev.live_eval(model, teacher, [prompt], max_new_tokens=8, eos=set(), layer_ids=LAYERS,
                           sampling=SamplingParams(1.0, top_p=0.9), seed=3)
    assert len(sampled.prompts[0].generated) == 8 and 1.0 <= sampled.tau <= model.config.block_size


def test_warp_and_params():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    torch.testing.assert_close(warp(logits, SamplingParams(1.0)), logits.softmax(-1))
    assert warp(logits, SamplingParams(1.0, top_k=2))[0, 2:].sum() == 0
    p = logits.softmax(-1)[0]
    kept = warp(logits, SamplingParams(1.0, top_p=float(p[0]) + 1e-3))[0]  # needs the top two tokens
    assert (kept > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(kept[:2], p[:2] / p[:2].sum())
    torch.testing.assert_close(warp(logits, SamplingParams(0.5)), (logits * 2).softmax(-1))
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_extract_distill_then_sampled_live_eval_through_the_commands(tmp_path, capsys, monkeypatch):
    """``dflash-extract`` with the final state -> ``dflash-train`` with an LK loss -> ``dflash-train eval --live
    --temperature 1 --top-k 8``: tau from speculative sampling, lossless in distribution."""
    import json
    from pathlib import Path

    from extract.cli import main as extract_main
    from train.cli import main as train_main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    cache_url, run = str(tmp_path / "cache"), tmp_path / "run"
    sets = [a for s in ["data.path=builtin:tiny-chat?n=20", "extract.unit_size=32", "train.max_steps=3",
                        "train.num_anchors=8", "loader.tokens_per_batch=1024", "loader.holdout_fraction=0.3",
                        "checkpoint.every_steps=3", "eval.live_prompts=2", "eval.live_max_new_tokens=12",
                        "metrics.progress_bar=false", "metrics.tensorboard=false", "train.loss=lk_lambda",
                        "train.loss_ce_weight=0.5"] for a in ("--set", s)]
    assert extract_main(["configs/tiny.toml", "--out", cache_url, "--no-progress", "--set",
                         "cache.store_final_hidden=true", *sets]) == 0
    assert train_main(["configs/tiny.toml", "--cache", cache_url, "--run-dir", str(run), *sets]) == 0
    capsys.readouterr()
    assert train_main(["eval", "configs/tiny.toml", "--cache", cache_url, "--checkpoint", str(run), "--live",
                       "--temperature", "1.0", "--top-k", "8", "--seed", "4", "--json", *sets]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert live["lossless"] == "in distribution" and live["sampling"] == {"temperature": 1.0, "top_p": 1.0,
                                                                          "top_k": 8}
    assert len(live["prompts"]) == 2 and all(p["tau"] >= 1.0 for p in live["prompts"])
    assert train_main(["eval", "configs/tiny.toml", "--cache", cache_url, "--checkpoint", str(run), "--live",
                       "--temperature", "-1", *sets]) == 2


# ---- the shipped dflash.py has its own copy of the rule: the same statistics for both ----------------------


@functools.cache
def _shipped_module():
    """train/models/hf_modeling/dflash.py loaded as the engines and users load it: a standalone file."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "train" / "models" / "hf_modeling" / "dflash.py"
    spec = importlib.util.spec_from_file_location("shipped_dflash", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _train_rule(drafts, q, p, gen):
    return RejectionSampler(gen).verify(drafts.tolist(), q, p)[0]


def _shipped_rule(drafts, q, p, gen):
    accepted, nxt = _shipped_module().speculative_sampling(drafts, q, p, gen)
    return int(drafts[0]) if accepted else nxt


def _shipped_wrong_residual(drafts, q, p, gen):
    accepted, _ = _shipped_module().speculative_sampling(drafts, q, p, gen)
    return int(drafts[0]) if accepted else int(torch.multinomial(p[0], 1, generator=gen))


def first_token_counts(rule, p1: torch.Tensor, q: torch.Tensor, seed: int) -> dict[tuple, int]:
    """DRAWS cycles of one drafted block (drafts from q [k, V]) verified against p1 (the teacher's distribution
    for the first drafted position): counts of the first emitted token, which must be distributed as p1."""
    gen = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    p = p1.expand(k + 1, -1).contiguous()  # later rows do not affect the first emitted token
    counts: dict[tuple, int] = {}
    for _ in range(DRAWS):
        drafts = torch.multinomial(q, 1, generator=gen).view(-1)
        x = rule(drafts, q, p, gen)
        counts[(x,)] = counts.get((x,), 0) + 1
    return counts


@pytest.mark.parametrize("rule", [_train_rule, _shipped_rule])
def test_both_copies_of_the_rule_sample_the_teacher_and_the_harness_catches_a_wrong_one(tiny_teacher, prompt, rule):
    teacher, _ = tiny_teacher
    logits = ev._teacher_logits_step(teacher, prompt, LAYERS)[1][-1]
    p1 = warp(logits, PARAMS)  # [V], 4 tokens
    want = {(x,): float(p1[x]) for x in p1.nonzero().flatten().tolist()}
    sharper = warp(logits, SamplingParams(0.25, top_k=4)).expand(3, -1).contiguous()  # overlapping proposal
    drafter_q = warp(ev.draft_logits(_drafter(teacher), ev._teacher_logits_step(teacher, prompt, LAYERS)[0][:-1],
                                     prompt[-1]), PARAMS)  # the real drafter's rows
    for q in (sharper, drafter_q):
        assert chi_square_pvalue(first_token_counts(rule, p1, q, 7), want, DRAWS) > 1e-3
    assert chi_square_pvalue(first_token_counts(_shipped_wrong_residual, p1, sharper, 7), want, DRAWS) < 1e-6


def test_shipped_spec_generate_samples_the_teachers_distribution(tmp_path, tiny_teacher, prompt):
    """The exported drafter's spec_generate at T=1, top-k 4: the first two new tokens over 400 decodings follow
    the teacher's exact distribution (the full loop; the rule itself is tested over 2000 draws above)."""
    from test_export_hf import _export, _load, _teacher_drafter

    teacher, _ = tiny_teacher
    draft = _load(_export(_teacher_drafter(teacher), tmp_path / "export"))
    want = exact_distribution(ev._teacher_logits_step, teacher, prompt, PARAMS, 2)
    ids = torch.tensor([prompt])
    gen = torch.Generator().manual_seed(11)
    counts: dict[tuple, int] = {}
    n = 400
    for _ in range(n):
        out = draft.spec_generate(teacher, ids, 2, None, 1.0, top_k=4, generator=gen)
        key = tuple(out[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert sum(len(k) == 2 for k in counts) == len(counts)
    assert chi_square_pvalue(counts, want, n) > 1e-3
    greedy = draft.spec_generate(teacher, ids, 6, None, 0.0)
    assert torch.equal(greedy, teacher.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                                do_sample=False, pad_token_id=0))

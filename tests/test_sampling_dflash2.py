"""Sampled verification with a DFlash2 drafter: the proposal is the candidate selector's walk (each draft drawn
from softmax(scores / T) over its row's K candidates given the draft before), q is that distribution. The tokens
produced by ``eval --live``'s loop and by the shipped ``spec_generate`` follow the teacher's own sampling
(chi-square over >= 2000 draws, helpers from test_sampling.py), and verifying against the unary distribution
instead of the selector's is caught."""

from __future__ import annotations

import hashlib

import pytest
import test_sampling
import torch
from test_sampling import DRAWS, LAYERS, PARAMS, _shipped_module, chi_square_pvalue, draw, exact_distribution

import train.tools.evaluate as ev
from train.models.dflash2 import DFlash2Drafter
from train.tools.sampling import RejectionSampler, warp

# test_sampling's fixtures: the tiny teacher, the prompt, the memoized teacher and drafter forwards
tiny_teacher, prompt, memoized = test_sampling.tiny_teacher, test_sampling.prompt, test_sampling.memoized
K = 4  # the selector's candidates per row (the teacher's top-k support is 4 tokens too)


def dflash2_from_teacher(teacher, pair_scale: float) -> DFlash2Drafter:
    """A DFlash2 drafter on the teacher's embeddings and head: random convolutions, and a selector whose pair
    scores are of order ``pair_scale`` (so they move the proposal away from the unary distribution)."""
    from test_export_hf import _teacher_drafter

    base = _teacher_drafter(teacher, arch="dflash2", conv_group_size=16, selector_top_k=K, selector_rank=4)
    model = DFlash2Drafter(base.config, base.embed_tokens, base.lm_head, attention="sdpa").eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "candidate_selector" in name:  # the hidden projection [r, H] of unit-RMS rows
                p.copy_(torch.randn(p.shape, generator=g) * pair_scale / (2 * p.shape[1] ** 0.5))
    return model


def teacher_final_hidden(teacher, ids: list[int]) -> torch.Tensor:
    """The teacher's normed final hidden state after ``ids`` [H]: its head gives the teacher's next-token logits."""
    with torch.no_grad():
        out = teacher(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1]


@pytest.fixture
def memoized_hidden(memoized, monkeypatch):
    """As test_sampling's ``memoized``, plus the drafter forward the selector proposal runs (draft_hidden)."""
    step = ev.draft_hidden
    memo: dict = {}

    def hidden(model, ctx_features, last_token):
        key = (id(model), hashlib.sha1(ctx_features.numpy().tobytes()).hexdigest(), last_token)
        if key not in memo:
            memo[key] = step(model, ctx_features, last_token)
        return memo[key]

    monkeypatch.setattr(ev, "draft_hidden", hidden)
    return memoized


def informative(teacher, monkeypatch, unary_q: bool = False):
    """The selector proposal run on rows whose hidden state is the teacher's own (normed, final) after the
    accepted tokens and the anchor: the unary head then gives the teacher's logits, so the drafts overlap the
    teacher's distribution and the verification rule decides what is kept. ``unary_q``: a wrong rule that
    verifies the selector's drafts against the unary distribution warp(logits) instead of the selector's q."""
    memo: dict = {}
    current: list[list[int]] = [[]]

    def hidden(model, ctx_features, last_token):
        key = tuple(current[0])
        if key not in memo:
            memo[key] = teacher_final_hidden(teacher, current[0]).expand(model.config.block_size - 1, -1)
        return memo[key]  # [B-1, H]

    monkeypatch.setattr(ev, "draft_hidden", hidden)

    def proposal(model, ctx_tokens, ctx_features, last_token, params, sampler):
        current[0] = list(ctx_tokens) + [last_token]
        drafts, q = ev.selector_proposal(model, ctx_tokens, ctx_features, last_token, params, sampler)
        if unary_q:
            q = warp(model.logits(hidden(model, ctx_features, last_token)), params)  # [B-1, V]
        return drafts, q

    return proposal


def test_the_live_eval_loop_picks_the_selector_proposal_for_dflash2(tiny_teacher, prompt, monkeypatch):
    teacher, _ = tiny_teacher
    model = dflash2_from_teacher(teacher, 1.0)
    used = []
    real = ev.selector_proposal

    def spy(*args):
        used.append(1)
        return real(*args)

    monkeypatch.setattr(ev, "selector_proposal", spy)
    res = ev.live_eval(model, teacher, [prompt], max_new_tokens=6, eos=set(), layer_ids=LAYERS, sampling=PARAMS,
                       seed=1)
    assert used and len(res.prompts[0].generated) == 6 and 1.0 <= res.tau <= model.config.block_size


def test_a_dflash2_drafter_samples_exactly_the_teachers_distribution(tiny_teacher, prompt, memoized_hidden):
    """The real drafter forward and the selector's walk; verified by the rejection sampler."""
    teacher, _ = tiny_teacher
    model = dflash2_from_teacher(teacher, 1.0)
    want = exact_distribution(memoized_hidden, teacher, prompt, PARAMS, 3)
    counts, _ = draw(model, teacher, prompt, PARAMS, RejectionSampler(torch.Generator().manual_seed(1)),
                     ev.selector_proposal)
    assert sum(counts.values()) == DRAWS
    assert chi_square_pvalue(counts, want, DRAWS) > 1e-3


def test_the_selectors_q_passes_and_the_unary_q_fails(tiny_teacher, prompt, memoized, monkeypatch):
    teacher, _ = tiny_teacher
    model = dflash2_from_teacher(teacher, 3.0)
    # precondition: the teacher's hidden gives the teacher's logits, and the selector moves the proposal
    h = teacher_final_hidden(teacher, list(prompt))
    torch.testing.assert_close(model.logits(h.unsqueeze(0))[0], memoized(teacher, list(prompt), LAYERS)[1][-1],
                               rtol=1e-4, atol=1e-4)
    want = exact_distribution(memoized, teacher, prompt, PARAMS, 3)
    counts, acc = draw(model, teacher, prompt, PARAMS, RejectionSampler(torch.Generator().manual_seed(2)),
                       informative(teacher, monkeypatch))
    assert 0.3 < acc < 2.7  # drafts kept and rejected alike: the rule matters
    assert chi_square_pvalue(counts, want, DRAWS) > 1e-3
    counts, _ = draw(model, teacher, prompt, PARAMS, RejectionSampler(torch.Generator().manual_seed(2)),
                     informative(teacher, monkeypatch, unary_q=True))
    assert chi_square_pvalue(counts, want, DRAWS) < 1e-6


# ---- the shipped dflash.py: DFlash2DraftModel.draft + speculative_sampling, and spec_generate ----------------


@pytest.fixture(scope="module")
def shipped_dflash2(tiny_teacher, tmp_path_factory):
    from test_export_hf import _export, _load

    teacher, _ = tiny_teacher
    draft = _load(_export(dflash2_from_teacher(teacher, 3.0), tmp_path_factory.mktemp("dflash2") / "export"))
    assert type(draft).__name__ == "DFlash2DraftModel" and type(draft).__module__ != "train.models.dflash2"
    return draft


def _shipped_first_tokens(draft, teacher, prompt, hidden, unary_q: bool, seed: int) -> dict[tuple, int]:
    """DRAWS cycles of one block drafted by the shipped ``draft`` (rows' hidden [1, L, H]) after the teacher's
    first token, verified by the shipped ``speculative_sampling``: counts of (first token, next emitted)."""
    shipped = _shipped_module()
    head = teacher.get_output_embeddings()
    gen = torch.Generator().manual_seed(seed)
    p_first = warp(ev._teacher_logits_step(teacher, prompt, LAYERS)[1][-1], PARAMS)
    p_memo: dict = {}
    counts: dict[tuple, int] = {}
    for _ in range(DRAWS):
        x0 = int(torch.multinomial(p_first, 1, generator=gen))
        drafts, q = draft.draft(hidden[x0], torch.tensor([x0]), head, 1.0, 1.0, PARAMS.top_k, gen)
        if unary_q:
            q = shipped.warp_probs(draft.compute_logits(hidden[x0], head)[0], 1.0, 1.0, PARAMS.top_k)
        key = (x0, *drafts[0].tolist())
        if key not in p_memo:
            logits = ev._teacher_logits_step(teacher, list(prompt) + list(key), LAYERS)[1]
            p_memo[key] = shipped.warp_probs(logits[len(prompt):], 1.0, 1.0, PARAMS.top_k)  # [L+1, V]
        accepted, nxt = shipped.speculative_sampling(drafts[0], q, p_memo[key], gen)
        second = int(drafts[0, 0]) if accepted else nxt
        counts[(x0, second)] = counts.get((x0, second), 0) + 1
    return counts


def test_shipped_dflash2_draft_and_rule_sample_the_teacher_and_the_unary_q_fails(tiny_teacher, prompt,
                                                                                 shipped_dflash2):
    teacher, _ = tiny_teacher
    want = exact_distribution(ev._teacher_logits_step, teacher, prompt, PARAMS, 2)
    L = shipped_dflash2.block_size - 1
    # each anchor's rows: the teacher's own hidden after it (the unary head gives the teacher's logits)
    hidden = {x: teacher_final_hidden(teacher, list(prompt) + [x]).expand(1, L, -1) for (x, _) in want}
    counts = _shipped_first_tokens(shipped_dflash2, teacher, prompt, hidden, False, 5)
    assert chi_square_pvalue(counts, want, DRAWS) > 1e-3
    counts = _shipped_first_tokens(shipped_dflash2, teacher, prompt, hidden, True, 5)
    assert chi_square_pvalue(counts, want, DRAWS) < 1e-6


def test_shipped_spec_generate_with_a_dflash2_export_samples_the_teacher(tiny_teacher, prompt, shipped_dflash2):
    """The full loop of the exported DFlash2 drafter at T=1, top-k 4: the first two new tokens over DRAWS
    decodings follow the teacher's exact distribution."""
    teacher, _ = tiny_teacher
    want = exact_distribution(ev._teacher_logits_step, teacher, prompt, PARAMS, 2)
    ids = torch.tensor([prompt])
    gen = torch.Generator().manual_seed(11)
    counts: dict[tuple, int] = {}
    for _ in range(DRAWS):
        out = shipped_dflash2.spec_generate(teacher, ids, 2, None, 1.0, top_k=PARAMS.top_k, generator=gen)
        key = tuple(out[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, want, DRAWS) > 1e-3


@pytest.mark.parametrize("sets", [["model.arch=dflash2", "train.loss=kl"], ["model.output_multiplier=2.0",
                                                                            "train.loss=lk_lambda"]])
def test_dflash_train_refuses_a_distribution_loss_with_dflash2_or_a_logit_transform(tmp_path, capsys, monkeypatch,
                                                                                    sets):
    """Those drafters train through the selector loss (CE unary part): dflash-train exits 2 naming train.loss,
    before reading the cache."""
    from pathlib import Path

    from train.cli import main as train_main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    args = [a for s in sets for a in ("--set", s)]
    assert train_main(["configs/tiny.toml", "--cache", str(tmp_path / "none"), "--run-dir", str(tmp_path / "r"),
                       *args]) == 2
    err = capsys.readouterr().err
    assert "train.loss" in err and "use train.loss = ce" in err, err
    assert not (tmp_path / "r").exists()


def test_extract_distill_dflash2_then_sampled_live_eval_through_the_commands(tmp_path, capsys, monkeypatch):
    """``dflash-extract`` -> ``dflash-train`` a DFlash2 drafter -> ``dflash-train eval --live --temperature 1``:
    the selector's proposal verified by speculative sampling."""
    import json
    from pathlib import Path

    from extract.cli import main as extract_main
    from train.cli import main as train_main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    used = []
    real = ev.selector_proposal
    monkeypatch.setattr(ev, "selector_proposal", lambda *a: used.append(1) or real(*a))
    cache_url, run = str(tmp_path / "cache"), tmp_path / "run"
    sets = [a for s in ["data.path=builtin:tiny-chat?n=20", "extract.unit_size=32", "train.max_steps=2",
                        "train.num_anchors=8", "loader.tokens_per_batch=1024", "loader.holdout_fraction=0.3",
                        "checkpoint.every_steps=2", "eval.live_prompts=2", "eval.live_max_new_tokens=8",
                        "metrics.progress_bar=false", "metrics.tensorboard=false", "model.arch=dflash2",
                        "model.conv_group_size=16", "model.selector_top_k=8"] for a in ("--set", s)]
    assert extract_main(["configs/tiny.toml", "--out", cache_url, "--no-progress", *sets]) == 0
    assert train_main(["configs/tiny.toml", "--cache", cache_url, "--run-dir", str(run), *sets]) == 0
    capsys.readouterr()
    assert train_main(["eval", "configs/tiny.toml", "--cache", cache_url, "--checkpoint", str(run), "--live",
                       "--temperature", "1.0", "--top-p", "0.9", "--seed", "4", "--json", *sets]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert live["lossless"] == "in distribution" and len(live["prompts"]) == 2
    assert all(p["tau"] >= 1.0 for p in live["prompts"]) and used
